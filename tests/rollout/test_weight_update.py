"""Weight updates without restarting the engine: updated engine == fresh engine on the new weights,
version tags on every output, and nothing computed by an older version is served afterwards
(neither a resident session's state nor a prefix-cache block)."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import SMALL_ENGINE

from rollout.worker import RolloutWorker, TurnRequest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def checkpoints(tiny_ckpt, tmp_path_factory):
    from model.modeling import HybridForCausalLM
    from rollout.tokenizer import load_tokenizer

    path0, _ = tiny_ckpt
    path1 = tmp_path_factory.mktemp("tiny_hybrid_v1")
    model1 = HybridForCausalLM.from_pretrained(str(path0)).eval()  # a copy: the shared model stays v0
    torch.manual_seed(123)
    with torch.no_grad():
        for p in model1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model1.save_pretrained(str(path1))
    load_tokenizer().save_pretrained(str(path1))
    return path0, path1, model1


@pytest.fixture(scope="module")
def engines(checkpoints):
    path0, path1, _ = checkpoints
    workers = {
        "session": RolloutWorker(dict(model_path=str(path0), reuse="session", **SMALL_ENGINE)),
        "prefix": RolloutWorker(dict(model_path=str(path0), reuse="prefix_cache", **SMALL_ENGINE)),
        "fresh": RolloutWorker(dict(model_path=str(path1), reuse="none", policy_version=1, **SMALL_ENGINE)),
    }
    yield workers
    for w in workers.values():
        w.shutdown()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turn(w, sid, ids, n=8):
    return w.generate([TurnRequest(sid, ids, max_tokens=n, temperature=0.0)])[0]


def test_updated_engines_equal_a_fresh_engine_and_serve_nothing_stale(engines, checkpoints):
    _, path1, model1 = checkpoints
    s, pc, fresh = engines["session"], engines["prefix"], engines["fresh"]
    first, second, shared = _ids(1, 50), _ids(2, 12), _ids(3, 300)

    before = _turn(s, "ep", first)  # a resident session computed with version 0
    assert before.policy_version == 0
    cold = _turn(pc, "a", shared)
    warm = _turn(pc, "b", shared)
    assert warm.num_computed_prompt_tokens < cold.num_computed_prompt_tokens  # prefix cache really hits

    report = s.update_weights(str(path1), version=1)  # from a checkpoint directory
    state_dict = {k: v.detach().clone() for k, v in model1.state_dict().items()}
    report_pc = pc.update_weights(state_dict, version=1)  # from learner tensors
    assert report["version"] == report_pc["version"] == 1
    assert report["tensors"] == report_pc["tensors"] == len(state_dict) - 1  # tied lm_head is the embedding

    after = _turn(s, "ep", second)  # the session's old-version state must not be continued
    history = first + before.token_ids + second
    ref = _turn(fresh, "ep", history)
    assert not after.reused_session and after.num_computed_prompt_tokens == len(history)
    assert after.token_ids == ref.token_ids and after.policy_version == ref.policy_version == 1
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    assert ref.token_ids == model1.generate(torch.tensor([history]), max_new_tokens=8)[0, -8:].tolist()

    again = _turn(pc, "c", shared)  # same prompt as before the update: no block of version 0 matches
    ref2 = _turn(fresh, "c", shared)
    assert again.num_computed_prompt_tokens == len(shared)
    assert again.token_ids == ref2.token_ids and again.policy_version == 1
    torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(ref2.logprobs), atol=1e-4, rtol=0)
    for w in (s, pc, fresh):
        w.end_sessions(["ep", "a", "b", "c"])


def test_bad_weights_are_rejected_by_name(engines, tmp_path):
    with pytest.raises(FileNotFoundError):
        engines["session"].update_weights(str(tmp_path / "missing.safetensors"), version=2)
    with pytest.raises(ValueError, match="no counterpart"):
        engines["session"].update_weights({"not.a.weight": torch.zeros(1)}, version=2)
    with pytest.raises(ValueError, match="shape"):
        engines["session"].update_weights({"lm_head.weight": torch.zeros(3, 3)}, version=2)
    assert engines["session"].get_version() == 1
