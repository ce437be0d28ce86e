"""Our model in a real vLLM engine (CPU, fp32): parity with the learner, whole-turn state reuse,
routed experts, residency bounds. One engine for the whole module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rollout.worker import TurnRequest

pytestmark = pytest.mark.vllm
BENCH = Path(__file__).resolve().parents[2] / "bench" / "op_counts.py"  # its OpCounter (the ``bench`` fixture)

# Rollout and learner run the same fp32 modules; what differs is how tokens are grouped (the
# learner's one chunked pass over the whole sequence vs vLLM's prefill + token-by-token recurrent
# decode, paged attention vs SDPA), i.e. fp32 rounding order only: observed max 9.5e-7 (mean 2.3e-7
# over 256 sampled tokens, contexts up to 700), bound 2e-5.
LOGPROB_TOL = 2e-5


@pytest.fixture(scope="module")
def worker(session_worker):
    return session_worker


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def learner_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) for t >= 1 from the learner."""
    with torch.no_grad():
        x = torch.tensor([ids])
        return model(x[:, :-1], target_ids=x[:, 1:]).token_logprobs[0]


def test_greedy_decode_equals_model_generate(worker, tiny_ckpt):
    _, model = tiny_ckpt
    prompts = {"g0": _prompt(0, 40), "g1": _prompt(1, 75)}
    outs = worker.generate([TurnRequest(s, p, max_tokens=12, temperature=0.0) for s, p in prompts.items()])
    for o in outs:
        ref = model.generate(torch.tensor([prompts[o.session_id]]), max_new_tokens=12)[0, -12:].tolist()
        assert o.token_ids == ref
        assert o.finish_reason == "length" and o.policy_version == 0
    worker.end_sessions(list(prompts))


def assert_sampled_logprobs_equal_learner(worker, model, session_id: str, prompt: list[int]) -> None:
    """24 sampled tokens: the engine's logprobs against the learner's on the same ids."""
    o = worker.generate([TurnRequest(session_id, prompt, max_tokens=24, temperature=1.0)])[0]
    assert len(o.token_ids) == len(o.logprobs) == 24
    ref = learner_logprobs(model, prompt + o.token_ids)[len(prompt) - 1 :]
    diff = (torch.tensor(o.logprobs) - ref).abs().max().item()
    assert diff < LOGPROB_TOL, diff
    worker.end_sessions([session_id])


def test_sampled_logprobs_equal_learner_logprobs(worker, tiny_ckpt):
    assert_sampled_logprobs_equal_learner(worker, tiny_ckpt[1], "lp", _prompt(2, 60))


def test_recorded_sampled_logprobs_equal_vllms_own(worker, monkeypatch):
    """The step records' sampled logprobs (the worker's default source) are vLLM's own logprob outputs, bit for
    bit, on the same sampled tokens: greedy, and sampled with temperature, top-p and top-k, over two turns of a
    reused session and a batch of three. With ``record_logprobs`` off the worker asks vLLM for them, and the
    records (the sampler hook stays installed) are checked against them turn by turn."""
    import rollout.worker as rw

    checked = []
    orig = rw.RolloutWorker._finish_turn

    def finish(self, p, rec):
        out = orig(self, p, rec)
        assert len(out.logprobs) == len(out.token_ids) > 0
        assert rec.sampled_logprobs(p.prompt_len, len(out.token_ids)) == out.logprobs
        checked.append(len(out.token_ids))
        return out

    monkeypatch.setattr(rw.RolloutWorker, "_finish_turn", finish)
    monkeypatch.setattr(worker.config, "record_logprobs", False)
    sampling = [dict(temperature=0.0), dict(temperature=0.7, top_p=0.9, top_k=20), dict(temperature=1.3, top_k=5)]
    ids = [f"rec{i}" for i in range(len(sampling))]
    for turn in range(2):
        reqs = [TurnRequest(s, _prompt(30 + 3 * turn + i, 20 + 7 * i), max_tokens=9, **kw)
                for i, (s, kw) in enumerate(zip(ids, sampling))]  # fmt: skip
        worker.generate(reqs)
    worker.end_sessions(ids)
    assert checked == [9] * 6


def _batch_episode(worker, prefix: str, stop: tuple[int, ...]) -> list:
    """Three sessions of three turns in batched generate calls, with other lengths and a shared stop id set."""
    outs = []
    ids = [f"{prefix}{i}" for i in range(3)]
    for turn in range(3):
        reqs = [TurnRequest(s, _prompt(50 + 3 * turn + i, 15 + 9 * i), max_tokens=4 + 3 * i, temperature=0.0,
                            stop_token_ids=list(stop)) for i, s in enumerate(ids)]  # fmt: skip
        outs.extend(worker.generate(reqs))
    worker.end_sessions(ids)
    return outs


@pytest.mark.parametrize("record_logprobs", [True, False])
def test_final_and_delta_turn_outputs_hand_back_the_same_turns(worker, monkeypatch, record_logprobs):
    """``turn_outputs="final"`` (one vLLM output a request at its turn's end, which for a reused session holds the
    earlier turns' tokens too) and ``"delta"`` (one a step) give the same turns: tokens, logprobs (from the step
    records or from vLLM), ends, routes, computed tokens, reuse. Turns end at max_tokens and on a stop id."""
    monkeypatch.setattr(worker.config, "record_logprobs", record_logprobs)
    free = _batch_episode(worker, "fd", ())
    stop = (free[1].token_ids[2],)  # ends a turn of the second session early
    runs = {}
    for kind in ("delta", "final"):
        monkeypatch.setattr(worker.config, "turn_outputs", kind)
        runs[kind] = _batch_episode(worker, kind, stop)
    assert {o.finish_reason for o in runs["final"]} == {"stop", "length"}
    assert sum(o.reused_session for o in runs["final"]) == 6
    for a, b in zip(runs["delta"], runs["final"]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and len(b.token_ids) > 0
        assert a.logprobs == b.logprobs and len(b.logprobs) == len(b.token_ids)
        assert (a.num_computed_prompt_tokens, a.reused_session, a.context_len, a.stop_token_id) == (
            b.num_computed_prompt_tokens, b.reused_session, b.context_len, b.stop_token_id)  # fmt: skip
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_array_equal(a.prompt_routed_experts, b.prompt_routed_experts)


def test_a_turn_longer_than_the_stall_limit_is_progress_with_final_outputs(worker, monkeypatch):
    """With final outputs most steps hand back nothing; the worker's stall check counts the engine core's
    per-step reports instead, so a turn of more steps than ``stall_steps`` closes no parked session."""
    monkeypatch.setattr(worker.config, "turn_outputs", "final")
    worker.generate([TurnRequest("parked", _prompt(60, 30), max_tokens=3, temperature=0.0)])
    monkeypatch.setattr(worker.config, "stall_steps", 2)
    long = worker.generate([TurnRequest("long", _prompt(61, 30), max_tokens=12, temperature=0.0)])[0]
    assert len(long.token_ids) == 12
    again = worker.generate([TurnRequest("parked", _prompt(62, 5), max_tokens=3, temperature=0.0)])[0]
    assert again.reused_session
    worker.end_sessions(["parked", "long"])


def test_a_missing_sampled_logprob_is_an_error():
    from rollout.engine_hooks import RequestRecord

    rec = RequestRecord(sampled={10: -0.5, 11: -1.5})
    assert rec.sampled_logprobs(10, 2) == [-0.5, -1.5]
    with pytest.raises(RuntimeError, match=r"positions \[12\]"):
        rec.sampled_logprobs(10, 3)


def assert_last_turn_equals_the_learner(model, turns: list[list[int]], outs) -> None:
    """The episode's context is its chunks and sampled tokens, and the last turn's logprobs are the learner's on it."""
    history = [t for chunk, o in zip(turns, outs) for t in (*chunk, *o.token_ids)]
    assert outs[-1].context_len == len(history)
    ref = learner_logprobs(model, history)
    pos = len(history) - len(outs[-1].token_ids)
    np.testing.assert_allclose(outs[-1].logprobs, ref[pos - 1 :].numpy(), atol=LOGPROB_TOL)


def _episode(worker, sid: str, turns: list[list[int]], fresh_each_turn: bool, stop: tuple[int, ...] = ()):
    outs = []
    for chunk in turns:
        if fresh_each_turn:
            worker.end_sessions([sid])
            history = [t for prev, o in zip(turns, outs) for t in (*prev, *o.token_ids)]
            chunk = history + chunk  # a new session over the full history: recompute
        req = TurnRequest(sid, chunk, max_tokens=10, temperature=0.0, stop_token_ids=list(stop))
        outs.append(worker.generate([req])[0])
    worker.end_sessions([sid])
    return outs


def test_whole_turn_reuse_prefills_only_new_tokens_and_matches_recompute(worker, tiny_ckpt):
    _, model = tiny_ckpt
    turns = [_prompt(3, 90), _prompt(4, 17), _prompt(5, 33), _prompt(6, 8)]
    reused = _episode(worker, "r", turns, fresh_each_turn=False)
    recomputed = _episode(worker, "f", turns, fresh_each_turn=True)
    block = worker.llm.llm_engine.vllm_config.cache_config.block_size
    for t, (a, b) in enumerate(zip(reused, recomputed)):
        assert a.token_ids == b.token_ids, t
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)
        if t >= 1:
            assert a.reused_session and not b.reused_session
            # new tokens + the previous turn's last sampled token (never fed before): <= new + one block
            assert a.num_computed_prompt_tokens == a.num_new_tokens + 1 <= a.num_new_tokens + block
            assert b.num_computed_prompt_tokens == b.context_len - len(b.token_ids)
    assert_last_turn_equals_the_learner(model, turns, reused)


def test_turns_ending_on_a_stop_token_reuse_the_session_like_a_recompute(worker, tiny_ckpt):
    """Turns that end on a stop token (the tool-call case) and not at max_tokens: the next turn starts with that
    token, which the engine never fed (an async scheduler would have: ``rollout.worker.scheduling_kwargs``),
    so the reused session equals a recompute and the learner on the full history."""
    _, model = tiny_ckpt
    turns = [_prompt(13, 70), _prompt(14, 21), _prompt(15, 12)]
    free = _episode(worker, "p", turns, fresh_each_turn=True)
    stop = tuple(sorted({o.token_ids[3] for o in free}))  # each turn's fourth greedy token ends it
    reused = _episode(worker, "rs", turns, fresh_each_turn=False, stop=stop)
    recomputed = _episode(worker, "fs", turns, fresh_each_turn=True, stop=stop)
    # the first turn ends on a stop token (at its fourth token or before), so the second starts after one
    assert reused[0].finish_reason == "stop" and len(reused[0].token_ids) <= 4
    for t, (a, b) in enumerate(zip(reused, recomputed)):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, t
        if a.finish_reason == "stop":
            assert a.token_ids[-1] in stop and a.stop_token_id == a.token_ids[-1], t
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_TOL)
        if t >= 1:
            assert a.reused_session and a.num_computed_prompt_tokens == a.num_new_tokens + 1
    assert_last_turn_equals_the_learner(model, turns, reused)


def test_a_prefill_over_kept_sessions_dispatches_no_ops_per_session(worker, bench):
    """The torch ops of one reused turn's prefill step, 2 sessions against 6: what a step launches on a GPU
    outside CUDA graphs (``bench/op_counts.py``'s count: ops that launch a kernel). The short convolutions once
    built each sequence's final conv state apart: 23 such ops more a session at 3 KDA layers (with views, 67;
    ~11,500 ops in a step of 64 sessions at gpu_1b, about the ~100 ms such steps took on the H200); now 5,
    vLLM's own per-request metadata."""

    def reused_turn_ops(n: int, tag: str) -> int:
        ids = [f"{tag}{i}" for i in range(n)]
        worker.generate([TurnRequest(s, _prompt(40 + i, 30), max_tokens=2, temperature=0.0) for i, s in enumerate(ids)])
        with bench.OpCounter() as counter:
            outs = worker.generate([TurnRequest(s, _prompt(60 + i, 9), max_tokens=1, temperature=0.0)
                                    for i, s in enumerate(ids)])  # fmt: skip
        worker.end_sessions(ids)
        assert all(o.reused_session for o in outs)
        return counter.total

    few, many = reused_turn_ops(2, "o"), reused_turn_ops(6, "O")
    assert (many - few) / 4 <= 8, f"{(many - few) / 4:.1f} ops more a session ({few} ops at 2 sessions, {many} at 6)"


def test_prefill_steps_take_the_offsets_from_vllms_host_copy(worker, monkeypatch):
    """The real engine's KDA metadata carries vLLM's host copy of the step's offsets (``KDAMetadataBuilder``), so the
    KDA layers' prefill layouts are built without reading the device offsets back (a device sync per cache group
    and step on a GPU)."""
    import rollout.vllm_layers as layers

    seen = []
    inner = layers._prefill_layout

    def recording(meta, *args):
        seen.append(getattr(meta, "_lh_query_start_cpu", None) is not None)
        return inner(meta, *args)

    monkeypatch.setattr(layers, "_prefill_layout", recording)
    worker.generate([TurnRequest(f"h{i}", _prompt(80 + i, 20 + 7 * i), max_tokens=2, temperature=0.0) for i in range(3)])
    worker.end_sessions([f"h{i}" for i in range(3)])
    assert seen and all(seen), seen


def test_routed_experts_match_the_learners_router(worker, tiny_ckpt):
    _, model = tiny_ckpt
    first, second = _prompt(7, 30), _prompt(8, 9)
    o1 = worker.generate([TurnRequest("e", first, max_tokens=6, temperature=1.0)])[0]
    o2 = worker.generate([TurnRequest("e", second, max_tokens=6, temperature=1.0)])[0]
    worker.end_sessions(["e"])
    ids = first + o1.token_ids + second + o2.token_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_router_choices=True).router_choices.numpy()  # [T, L, K]
    L, K = ref.shape[1:]
    assert o1.routed_experts.shape == (6, L, K)
    p1 = len(first)
    np.testing.assert_array_equal(np.sort(o1.routed_experts[:-1], -1), np.sort(ref[p1 : p1 + 5], -1))
    assert (o1.routed_experts[-1] == -1).all()  # the last sampled token is fed only with the next turn
    np.testing.assert_array_equal(np.sort(o2.prev_token_routed_experts, -1), np.sort(ref[p1 + 5], -1))


def test_resident_sessions_are_bounded_and_evicted_sessions_fall_back(worker, tiny_ckpt):
    _, model = tiny_ckpt
    saved, worker.max_resident = worker.max_resident, 2
    try:
        chunks = {s: [_prompt(10 + i, 20), _prompt(20 + i, 5)] for i, s in enumerate("abc")}
        first = worker.generate(
            [TurnRequest(f"b{s}", c[0], max_tokens=4, temperature=0.0) for s, c in chunks.items()]
        )
        assert worker.load()["resident"] == 2  # the third session ran as a plain request
        second = {}
        for s in "cab":  # each turn alone: room is made by closing the least recently used idle session
            second[s] = worker.generate([TurnRequest(f"b{s}", chunks[s][1], max_tokens=4, temperature=0.0)])[
                0
            ]
            assert worker.load()["resident"] <= 2
        assert worker.stats["evictions"] >= 2
        assert not second["c"].reused_session and not second["a"].reused_session
        for (s, c), o1 in zip(chunks.items(), first):
            ids = c[0] + o1.token_ids + c[1]
            assert (
                second[s].token_ids == model.generate(torch.tensor([ids]), max_new_tokens=4)[0, -4:].tolist()
            )
    finally:
        worker.end_sessions([f"b{s}" for s in "abc"])
        worker.max_resident = saved


def test_context_budget_and_bad_requests(worker):
    out = worker.generate([TurnRequest("ctx", _prompt(30, 700), max_tokens=200, temperature=0.0)])[0]
    assert len(out.token_ids) <= 768 - 700 and out.context_len <= 768
    full = worker.generate([TurnRequest("ctx", _prompt(31, 100), max_tokens=5)])[0]
    assert full.finish_reason == "context" and full.token_ids == []
    worker.end_sessions(["ctx"])
    with pytest.raises(ValueError, match="duplicated"):
        worker.generate([TurnRequest("d", [5]), TurnRequest("d", [6])])
    with pytest.raises(ValueError, match="at least one"):
        worker.generate([TurnRequest("z", [])])
    # a bad request is the caller's error, not the engine's: the worker stays usable (rollout.worker.check_usable)
    assert worker.failure is None and worker.get_version() == worker.version


def test_the_prefill_layout_is_built_once_per_step_metadata():
    """Every KDA layer of a cache group gets the same attention-metadata object for a step: the layout (and with it
    the KDA chunk plan) is built once for all of them, from vLLM's host copy of the offsets when the metadata has
    it, else from one read of the device offsets, and a metadata object of another step, or one that takes no new
    attributes, gets its own."""
    from types import SimpleNamespace

    from rollout.vllm_layers import _prefill_layout

    # 2 decodes (1 token each), then prefills of 5 and 3 tokens
    meta = SimpleNamespace(non_spec_query_start_loc=torch.tensor([0, 1, 2, 7, 10], dtype=torch.int32))
    cu, layout = _prefill_layout(meta, 2, 2, 2, 8, torch.device("cpu"))
    assert cu.tolist() == [0, 5, 8] and [(a, b) for _, a, b in layout.bounds] == [(0, 5), (5, 8)]
    again = _prefill_layout(meta, 2, 2, 2, 8, torch.device("cpu"))
    assert again[0] is cu and again[1] is layout  # the next layer of the step: no second host read
    other = SimpleNamespace(non_spec_query_start_loc=torch.tensor([0, 4, 6], dtype=torch.int32))
    cu2, layout2 = _prefill_layout(other, 0, 0, 2, 6, torch.device("cpu"))
    assert cu2.tolist() == [0, 4, 6] and layout2 is not layout

    # vLLM's host copy of the step's offsets (``KDAMetadataBuilder``): the layout comes from it and the device
    # offsets are never read (a meta tensor cannot be), only offset on the device for the kernels
    hosted = SimpleNamespace(non_spec_query_start_loc=torch.empty(5, dtype=torch.int32, device="meta"),
                             _lh_query_start_cpu=torch.tensor([0, 1, 2, 7, 10], dtype=torch.int32))  # fmt: skip
    cu3, layout3 = _prefill_layout(hosted, 2, 2, 2, 8, torch.device("cpu"))
    assert cu3.is_meta and cu3.shape == (3,) and [(a, b) for _, a, b in layout3.bounds] == [(0, 5), (5, 8)]
    assert layout3.cu_seqlens_N1.tolist() == [0, 5, 8]

    class Slotted:  # a metadata type without a __dict__
        __slots__ = ("non_spec_query_start_loc",)

    slotted = Slotted()
    slotted.non_spec_query_start_loc = meta.non_spec_query_start_loc
    assert _prefill_layout(slotted, 2, 2, 2, 8, torch.device("cpu"))[0].tolist() == [0, 5, 8]
