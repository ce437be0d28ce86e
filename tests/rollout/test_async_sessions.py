"""Session workers under vLLM's async scheduler (``WorkerConfig.async_sessions``), in a real vLLM engine (CPU,
fp32): the model's stale-step guard and the turn-end ids it is given.

vLLM's CPU platform turns the async scheduler off ("not required on CPU"); this module's engine is built with
it back on (the platform's config hook wrapped while the engine starts): vLLM's ``AsyncScheduler``, which runs
a decode step past each turn's stop token, and vLLM 0.32's rollback of a stopped session. With the guard, turns
ending on stop tokens reuse their sessions exactly like a recompute and like the learner; with the guard
switched off, the same episode parts from the recompute at its second turn (the stale step moved the parked
state). The async steps' input ids come from the plugin's fast path (``rollout.vllm_compat.install_input_ids``),
so these equalities hold with it. Also: a decode token whose input is a guarded id leaves the recurrent state as it
was, and the ids follow each generate call's requests.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_vllm_engine import (
    LOGPROB_TOL,
    _episode,
    _prompt,
    assert_last_turn_equals_the_learner,
    learner_logprobs,
)

from rollout.engine_hooks import set_turn_end_ids
from rollout.vllm_compat import INPUT_IDS_COUNTS
from rollout.worker import TurnRequest

pytestmark = pytest.mark.vllm
TURNS = [_prompt(13, 70), _prompt(14, 21), _prompt(15, 12)]
CHUNK = 64  # the engine's tokens a step: longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def stop(session_worker):
    """Stop ids that end each of TURNS' greedy turns early (each turn's fourth token, found on the plain
    session worker: the turns of one call on the guarded worker share their stop ids)."""
    free = _episode(session_worker, "free", TURNS, fresh_each_turn=True)
    return tuple(sorted({o.token_ids[3] for o in free}))


@pytest.fixture(scope="module")
def guarded(tiny_ckpt):
    from rollout_cases import SMALL_ENGINE
    from vllm.platforms.cpu import CpuPlatform

    from rollout.worker import RolloutWorker

    platform_hook = CpuPlatform.check_and_update_config.__func__

    def async_too(cls, vllm_config):
        platform_hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    path, _ = tiny_ckpt
    with pytest.MonkeyPatch.context() as mp:  # while the engine starts (its scheduler is chosen then)
        mp.setattr(CpuPlatform, "check_and_update_config", classmethod(async_too))
        w = RolloutWorker(dict(model_path=str(path), reuse="session", async_sessions=True,
                               max_num_batched_tokens=CHUNK, **SMALL_ENGINE))  # fmt: skip
    assert type(w.llm.llm_engine.engine_core.engine_core.scheduler).__name__ == "AsyncScheduler"
    yield w
    w.shutdown()


def _guard_ids(worker) -> set[int]:
    ids = worker.llm.collective_rpc(lambda w: w.model_runner.get_model().stale_step_guard.ids_S.tolist())[0]
    return {i for i in ids if i >= 0}


def test_guarded_sessions_ending_on_stop_tokens_equal_a_recompute(guarded, stop, tiny_ckpt):
    _, model = tiny_ckpt
    fast_steps = INPUT_IDS_COUNTS["fast"]
    reused = _episode(guarded, "rs", TURNS, fresh_each_turn=False, stop=stop)
    recomputed = _episode(guarded, "fs", TURNS, fresh_each_turn=True, stop=stop)
    assert INPUT_IDS_COUNTS["fast"] > fast_steps  # the steps' input ids came from the fast path
    assert reused[0].finish_reason == "stop"
    for t, (a, b) in enumerate(zip(reused, recomputed)):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, t
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)
        if t >= 1:  # the chunk starts with the stop token: fed as a prompt token, never guarded
            assert a.reused_session and a.num_computed_prompt_tokens == a.num_new_tokens + 1
    assert_last_turn_equals_the_learner(model, TURNS, reused)
    # the model's guard holds what ends these turns: the stop ids and the model's EOS
    assert set(stop) <= guarded.engine.turn_ends == _guard_ids(guarded)
    eos = guarded.llm.llm_engine.vllm_config.model_config.hf_config.eos_token_id
    assert eos in guarded.engine.turn_ends


def test_without_the_guard_the_stale_step_moves_the_parked_state(guarded, stop, monkeypatch):
    """The control: the async scheduler's step past the first turn's stop token, stepped with the session's
    state, leaves the reused session off the recompute from its second turn."""
    from rollout.vllm_layers import StaleStepGuard

    recomputed = _episode(guarded, "fs", TURNS, fresh_each_turn=True, stop=stop)
    monkeypatch.setattr(StaleStepGuard, "decode_slots", lambda self, slots_N: slots_N)
    unguarded = _episode(guarded, "us", TURNS, fresh_each_turn=False, stop=stop)
    assert unguarded[0].token_ids == recomputed[0].token_ids and unguarded[0].finish_reason == "stop"
    second = (unguarded[1].token_ids, recomputed[1].token_ids)
    assert second[0] != second[1] or np.abs(np.subtract(unguarded[1].logprobs, recomputed[1].logprobs)).max() > 1e-3


def test_one_call_s_turns_share_their_stop_ids_and_the_guard_follows_each_call(guarded, stop):
    other = [*stop, 999]
    mixed = [TurnRequest("x", _prompt(20, 30), max_tokens=4, temperature=0.0, stop_token_ids=list(stop)),
             TurnRequest("y", _prompt(21, 30), max_tokens=4, temperature=0.0, stop_token_ids=other)]  # fmt: skip
    with pytest.raises(ValueError, match="must share their stop_token_ids"):
        guarded.generate(mixed)
    assert "x" not in guarded.sessions and guarded.failure is None  # refused before any turn started
    guarded.generate(mixed[1:])  # alone, it runs: the guard now holds its ids
    assert 999 in guarded.engine.turn_ends == _guard_ids(guarded)
    guarded.generate(mixed[:1])
    assert 999 not in guarded.engine.turn_ends == _guard_ids(guarded)
    guarded.end_sessions(["x", "y"])


def test_a_decode_token_with_a_guarded_id_leaves_the_state_as_it_was(guarded, stop):
    """A guarded id sampled mid-turn (standing in for the stale step's stop token) is fed with no state: the
    KDA layers' recurrent and conv states miss it, so the next logprob moves; everything before is equal."""

    def turn(sid):
        req = TurnRequest(sid, _prompt(30, 40), max_tokens=8, temperature=0.0, stop_token_ids=list(stop))
        out = guarded.generate([req])[0]
        guarded.end_sessions([sid])
        return out

    plain = turn("plain")
    ends = set(guarded.engine.turn_ends)
    k = next(i for i, t in enumerate(plain.token_ids[:-1]) if t not in ends and t not in plain.token_ids[:i])
    guarded.llm.collective_rpc(set_turn_end_ids, args=(sorted(ends | {plain.token_ids[k]}),))
    try:
        frozen = turn("frozen")
    finally:
        guarded.llm.collective_rpc(set_turn_end_ids, args=(sorted(ends),))
    assert frozen.token_ids[: k + 1] == plain.token_ids[: k + 1]
    np.testing.assert_allclose(frozen.logprobs[: k + 1], plain.logprobs[: k + 1], atol=LOGPROB_TOL)
    assert abs(frozen.logprobs[k + 1] - plain.logprobs[k + 1]) > 100 * LOGPROB_TOL
    assert turn("again").logprobs == pytest.approx(plain.logprobs, abs=LOGPROB_TOL)  # the ids restored


@pytest.mark.parametrize("marked", [True, False])
def test_a_one_token_prompt_chunk_with_a_turn_end_id_is_fed(guarded, stop, tiny_ckpt, monkeypatch, marked):
    """A prompt whose last chunk is one token, a turn-end id: vLLM counts that chunk as a decode of a continuing
    state (a "short extend"), and the metadata builder marks it as a prompt row, so it is fed and the turn equals
    the learner. The control: unmarked, it is stepped with no state and the first sampled token's logprob parts."""
    from rollout.vllm_layers import StaleStepGuard

    _, model = tiny_ckpt
    if not marked:
        monkeypatch.setattr(StaleStepGuard, "set_prompt_decodes", lambda self, rows: None)
    prompt = [*_prompt(40, 2 * CHUNK), stop[0]]  # chunks of 64, 64 and 1
    req = TurnRequest("se", prompt, max_tokens=6, temperature=0.0, stop_token_ids=list(stop))
    out = guarded.generate([req])[0]
    guarded.end_sessions(["se"])
    ref = learner_logprobs(model, prompt + out.token_ids)[len(prompt) - 1 :].numpy()
    if marked:
        np.testing.assert_allclose(out.logprobs, ref, atol=LOGPROB_TOL)
    else:
        assert abs(out.logprobs[0] - ref[0]) > 100 * LOGPROB_TOL
