"""KDA states stacked in vLLM's slots (``kda_state_depth``, "auto" by default): the tiny model's 3 KDA layers as
one vLLM state layer beside its MLA layer make 2 KV-cache groups instead of 4, and the engine computes the same
function: the same greedy tokens and sampled logprobs as the one-layer-a-state engine (depth 1) and the learner,
over a reused session and beside another session (each in its own slot of the stacked states). The shared session
worker is the default (stacked) engine; one extra engine, the per-layer one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rollout_cases import SMALL_ENGINE
from test_vllm_engine import LOGPROB_TOL, _prompt, learner_logprobs

from rollout.vllm_plugin import kda_state_depth
from rollout.worker import RolloutWorker, TurnRequest, WorkerConfig

pytestmark = pytest.mark.vllm


def _groups(worker) -> list[tuple[str, int, tuple]]:
    """(spec type, layers, state shapes or ()) of each KV-cache group vLLM built."""

    def read(w):
        cfg = w.model_runner.kv_cache_config
        return [(type(g.kv_cache_spec).__name__, len(g.layer_names), tuple(getattr(g.kv_cache_spec, "shapes", ())))
                for g in cfg.kv_cache_groups]  # fmt: skip

    return worker.llm.collective_rpc(read)[0]


@pytest.fixture(scope="module")
def per_layer_worker(tiny_ckpt):
    path, _ = tiny_ckpt
    w = RolloutWorker(dict(model_path=str(path), reuse="session", kda_state_depth=1, **SMALL_ENGINE))
    yield w
    w.shutdown()


def test_stacked_states_make_two_cache_groups(per_layer_worker, session_worker, tiny_ckpt):
    _, model = tiny_ckpt
    lac = model.config.linear_attn_config
    per_layer, stack = _groups(per_layer_worker), _groups(session_worker)
    assert sorted(g[0] for g in per_layer) == ["FullAttentionSpec", "MambaSpec", "MambaSpec", "MambaSpec"]
    assert sorted(g[0] for g in stack) == ["FullAttentionSpec", "MambaSpec"]
    (mamba,) = [g for g in stack if g[0] == "MambaSpec"]
    one = next(g for g in per_layer if g[0] == "MambaSpec")
    assert mamba[1] == 1 and mamba[2] == tuple((len(lac["kda_layers"]), *s) for s in one[2])


def test_stacked_states_give_the_same_tokens_and_logprobs(per_layer_worker, session_worker, tiny_ckpt):
    """Two sessions side by side (two slots of the stack), each over two turns (the second continues the kept
    state): greedy tokens equal the one-layer-a-state engine's and ``generate``; sampled logprobs equal the
    learner's on the same ids."""
    _, model = tiny_ckpt
    stacked = session_worker
    first = {"sa": _prompt(60, 70), "sb": _prompt(61, 45)}
    second = {"sa": _prompt(62, 15), "sb": _prompt(63, 22)}
    outs = {}
    for w in (stacked, per_layer_worker):
        o1 = w.generate([TurnRequest(s, p, max_tokens=8, temperature=0.0) for s, p in first.items()])
        o2 = w.generate([TurnRequest(s, p, max_tokens=8, temperature=0.0) for s, p in second.items()])
        w.end_sessions(list(first))
        outs[w is stacked] = (o1, o2)
    for a1, a2, b1, b2 in zip(*outs[True], *outs[False]):
        assert a2.reused_session and a2.num_computed_prompt_tokens == len(second[a2.session_id]) + 1
        assert (a1.token_ids, a2.token_ids) == (b1.token_ids, b2.token_ids)
        history = first[a1.session_id] + a1.token_ids + second[a1.session_id]
        assert a2.token_ids == model.generate(torch.tensor([history]), max_new_tokens=8)[0, -8:].tolist()
    prompt = _prompt(64, 50)
    o = stacked.generate([TurnRequest("sl", prompt, max_tokens=16, temperature=1.0)])[0]
    stacked.end_sessions(["sl"])
    ref = learner_logprobs(model, prompt + o.token_ids)[len(prompt) - 1 :]
    diff = (torch.tensor(o.logprobs) - ref).abs().max().item()
    assert diff < LOGPROB_TOL, diff


def test_depth_is_resolved_from_the_config_and_bad_values_are_named(tiny_ckpt):
    def cfg(kda: int, mla: int, depth):
        layers = {"kda_layers": list(range(kda)), "full_attn_layers": list(range(mla))}
        return SimpleNamespace(linear_attn_config=layers, kda_state_depth=depth)

    assert kda_state_depth(cfg(12, 4, None)) == 3 and kda_state_depth(cfg(12, 4, 1)) == 1  # unset: auto
    assert kda_state_depth(cfg(12, 4, "auto")) == 3 and kda_state_depth(cfg(3, 1, "auto")) == 3
    assert kda_state_depth(cfg(13, 4, "auto")) == 1  # uneven: as it was
    assert kda_state_depth(cfg(12, 0, "auto")) == 1 and kda_state_depth(cfg(12, 4, 6)) == 6
    for bad in (5, 0, "deep", True, 2.0):
        with pytest.raises(ValueError, match="kda_state_depth"):
            kda_state_depth(cfg(12, 4, bad))
    path, _ = tiny_ckpt
    for bad in (0, "deep", True, 2):  # 2: the tiny model's 3 KDA layers do not split in twos
        with pytest.raises(ValueError, match="kda_state_depth"):
            WorkerConfig(model_path=str(path), kda_state_depth=bad)
    assert WorkerConfig(model_path=str(path), kda_state_depth=3).kda_state_depth == 3
