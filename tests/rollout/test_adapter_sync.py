"""Adapter-only weight sync: an engine given a LoRA adapter equals an engine given the merged full
weights of the same LoRA model; successive adapters are each relative to the base; a full update
replaces the base; bad adapters change nothing; versions and stale-cache rules as for full updates."""

from __future__ import annotations

import copy

import pytest
import torch
from test_vllm_engine import LOGPROB_TOL

from rollout.adapters import AdapterWeights, apply_adapter
from rollout.worker import RolloutWorker, TurnRequest

pytestmark = pytest.mark.vllm

ENGINE = dict(max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=16 << 20)


def _lora_model(base, seed: int):
    """A peft LoRA model on a copy of ``base`` with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model

    from model.lora import lora_target_modules, lora_target_parameters

    cfg = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=lora_target_modules(),
        target_parameters=lora_target_parameters(),  # the routed experts' stacked weights, one adapter per expert
    )
    peft_model = get_peft_model(copy.deepcopy(base), cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return peft_model


def _merged_state(peft_model) -> dict[str, torch.Tensor]:
    merged = copy.deepcopy(peft_model).merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


@pytest.fixture(scope="module")
def adapters(tiny_ckpt, tmp_path_factory):
    _, base = tiny_ckpt
    out = []
    for seed in (1, 2):
        peft_model = _lora_model(base, seed)
        path = tmp_path_factory.mktemp(f"adapter{seed}")
        peft_model.save_pretrained(str(path))
        out.append((str(path), _merged_state(peft_model), peft_model))
    return out


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    path0, _ = tiny_ckpt
    workers = {
        "adapter": RolloutWorker(dict(model_path=str(path0), reuse="session", **ENGINE)),
        "merged": RolloutWorker(dict(model_path=str(path0), reuse="none", **ENGINE)),
    }
    yield workers
    for w in workers.values():
        w.shutdown()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = {"p0": _ids(10, 40), "p1": _ids(11, 90)}


def _greedy(w: RolloutWorker, tag: str, n: int = 10):
    outs = w.generate(
        [TurnRequest(f"{tag}-{k}", ids, max_tokens=n, temperature=0.0) for k, ids in PROMPTS.items()]
    )
    w.end_sessions([o.session_id for o in outs])
    return outs


def _assert_same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        diff = (torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max().item()
        assert diff < LOGPROB_TOL, diff


def _weight(worker, name: str) -> torch.Tensor:
    def read(w, n):
        return dict(w.model_runner.get_model().named_parameters())[n].detach().clone()

    return worker.llm.collective_rpc(read, args=(name,))[0]


Q = "model.layers.0.self_attn.q_proj.weight"  # a KDA projection every adapter here targets


def test_adapter_update_equals_merged_update_and_never_accumulates(engines, adapters, tiny_ckpt):
    path0, base = tiny_ckpt
    a, m = engines["adapter"], engines["merged"]
    (dir1, merged1, peft1), (dir2, merged2, _) = adapters
    before = _greedy(a, "base")
    rep = a.update_weights(dir1, version=1)  # a peft adapter directory
    assert rep["adapter_only"] and rep["tensors"] == len(AdapterWeights.from_dir(dir1).tensors) // 2
    m.update_weights(merged1, version=1)
    out_a1, out_m1 = _greedy(a, "a1"), _greedy(m, "m1")
    assert [o.token_ids for o in out_a1] != [o.token_ids for o in before]  # the adapter really acts
    _assert_same(out_a1, out_m1)
    assert all(o.policy_version == 1 for o in out_a1)
    ids = torch.tensor([PROMPTS["p1"]])
    assert out_a1[1].token_ids == peft1.generate(input_ids=ids, max_new_tokens=10)[0, -10:].tolist()
    assert torch.equal(_weight(a, Q), merged1[Q])  # bitwise peft's merge (fp32 engine)
    experts = [k for k in merged1 if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and all(not torch.equal(merged1[k], base.state_dict()[k]) for k in experts)
    for k in experts:  # the stacked expert weights: one adapter per expert, peft's einsum
        torch.testing.assert_close(_weight(a, k), merged1[k], rtol=0, atol=1e-6)

    a.update_weights(AdapterWeights.from_dir(dir2), version=2, adapter_only=True)  # in-memory tensors
    m.update_weights(merged2, version=2)
    _assert_same(_greedy(a, "a2"), _greedy(m, "m2"))  # relative to the base, not to adapter 1
    assert torch.equal(_weight(a, Q), merged2[Q])

    # a full update replaces the base: the next adapter applies on top of the new full weights
    a.update_weights(merged1, version=3)
    a.update_weights(dir2, version=4)
    delta2 = merged2[Q] - base.state_dict()[Q]
    torch.testing.assert_close(_weight(a, Q), merged1[Q] + delta2, atol=1e-6, rtol=0)
    a.update_weights(str(path0), version=5)  # back to the base checkpoint (a full update)
    assert torch.equal(_weight(a, Q), base.state_dict()[Q])
    _assert_same(_greedy(a, "base-again"), before)
    # the directory's per-expert tensors rebased the stacked expert weights too: adapter 1 applies to the base
    a.update_weights(dir1, version=6)
    for k in experts:
        torch.testing.assert_close(_weight(a, k), merged1[k], rtol=0, atol=1e-6)


def test_adapter_update_closes_stale_sessions(engines, adapters):
    a = engines["adapter"]
    first = _ids(20, 30)
    t1 = a.generate([TurnRequest("ep", first, max_tokens=4, temperature=0.0)])[0]
    v = a.get_version()
    a.update_weights(adapters[0][0], version=v + 1)
    t2 = a.generate([TurnRequest("ep", [5, 6, 7], max_tokens=4, temperature=0.0)])[0]
    assert t2.policy_version == v + 1 == a.get_version() and not t2.reused_session
    assert t2.num_computed_prompt_tokens == len(first) + len(t1.token_ids) + 3  # recomputed on new weights
    a.end_sessions(["ep"])


def _replaced(adapter: AdapterWeights, part: str, value: torch.Tensor | None) -> AdapterWeights:
    """A copy with the tensor whose name contains ``part`` replaced (or dropped when ``value`` is None)."""
    tensors = dict(adapter.tensors)
    key = next(n for n in tensors if part in n)
    if value is None:
        del tensors[key]
    else:
        tensors[key] = value
    return AdapterWeights(tensors, adapter.r, adapter.alpha)


def test_bad_adapters_are_rejected_with_nothing_changed(engines, adapters, tmp_path):
    a = engines["adapter"]
    good = AdapterWeights.from_dir(adapters[0][0])
    w_before, version = _weight(a, Q), a.get_version()
    A = "layers.0.self_attn.q_proj.lora_A"
    extra = lambda name, t: AdapterWeights({**good.tensors, name: t}, good.r, good.alpha)
    cases = [
        (extra("base_model.model.model.nope.lora_A.weight", torch.zeros(4, 64)), "no module"),
        (extra("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64)), "not a LoRA weight"),
        # the router is not a Linear (not LoRA-targetable)
        (extra("base_model.model.model.layers.1.block_sparse_moe.gate.lora_A.weight", torch.zeros(4, 64)),
         "not an nn.Linear"),
        (_replaced(good, A, torch.zeros(4, 65)), "do not fit"),
        (_replaced(good, A, None), "needs lora_A and lora_B"),
    ]  # fmt: skip
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            a.update_weights(bad, version=99)
    with pytest.raises(ValueError, match="not full weights"):
        a.update_weights(adapters[0][0], version=99, adapter_only=False)
    with pytest.raises(ValueError, match="adapter_only update needs"):
        a.update_weights(str(tmp_path), version=99, adapter_only=True)
    assert torch.equal(_weight(a, Q), w_before) and a.get_version() == version


def test_adapter_config_features_that_cannot_be_applied_are_rejected(adapters, tmp_path, tiny_ckpt):
    import json
    import shutil

    src = adapters[0][0]
    for key, value in (("use_dora", True), ("alpha_pattern", {"q_proj": 4}), ("peft_type", "IA3")):
        d = tmp_path / key
        shutil.copytree(src, d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=key if key != "peft_type" else "not LORA"):
            AdapterWeights.from_dir(d)
    # the transport format (engine in another process) round-trips, rsLoRA scale included
    w = AdapterWeights.from_dir(src)
    w.use_rslora = True
    back = AdapterWeights.from_dir(w.save(tmp_path / "rt"))
    assert back.scale == pytest.approx(8 / 2) and back.tensors.keys() == w.tensors.keys()
    model = copy.deepcopy(tiny_ckpt[1])
    assert apply_adapter(model, back) == len(w.tensors) // 2
