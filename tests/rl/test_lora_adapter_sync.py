"""LoRA adapter-only sync, learner side: what the learner exports (adapter dir + base weights) is what a
rollout worker folds into its weights (``rollout.adapters.apply_adapter``, the function the engine
hook runs), and the result equals the learner's merged export bit for bit, step after step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_learner import batches_for, make_cfg, make_group

from rl.config import ConfigError
from rl.learner import Learner
from rollout.adapters import AdapterWeights, apply_adapter, is_adapter_dir


def _tensors(path: str, name: str) -> dict[str, torch.Tensor]:
    """A file's tensors, per-expert checkpoint tensors as the model's stacked expert weights."""
    from model.moe import stack_expert_weights

    num_experts = json.loads((Path(path) / "config.json").read_text())["num_experts"]
    return dict(stack_expert_weights(load_file(str(Path(path) / name)).items(), num_experts))


def test_adapter_export_applied_to_the_base_equals_the_merged_export(tmp_path):
    from model import HybridForCausalLM

    c = make_cfg("learner.lora.enabled=true", "learner.lora.r=4", "learner.lora.sync=adapter")
    learner = Learner(c.model, c.learner, c.algorithm)
    base = learner.export_base_weights(str(tmp_path / "base"))
    base_W = _tensors(base.path, "model.safetensors")
    worker_model = HybridForCausalLM.from_pretrained(base.path).eval()  # what the engine starts from
    for step in range(2):
        learner.train_step(batches_for(learner, c, make_group(seed=step)))
        upd = learner.export_weights(str(tmp_path / "w"))  # lora.sync=adapter: adapter only by default
        assert upd.adapter_only and is_adapter_dir(upd.path) and upd.version == step + 1
        merged = learner.export_weights(str(tmp_path / "m"), adapter_only=False)
        merged_W = _tensors(merged.path, "model.safetensors")
        assert apply_adapter(worker_model, AdapterWeights.from_dir(upd.path)) > 0
        changed = [k for k, v in merged_W.items() if not torch.equal(v, base_W[k])]
        assert changed, "training moved no adapter: the round trip would prove nothing"
        state = worker_model.state_dict()
        assert all(torch.equal(state[k], merged_W[k]) for k in merged_W), step
    # the base stays frozen: exporting it again after training gives the same tensors
    again = _tensors(learner.export_base_weights(str(tmp_path / "base2")).path, "model.safetensors")
    assert again.keys() == base_W.keys() and all(torch.equal(again[k], base_W[k]) for k in base_W)


def test_adapter_sync_cannot_ship_an_updated_balancing_bias(tmp_path):
    with pytest.raises(ConfigError, match="balancing bias"):
        make_cfg("learner.lora.enabled=true", "learner.lora.sync=adapter", "learner.balancer=update")
    make_cfg("learner.lora.enabled=true", "learner.lora.sync=adapter")  # frozen bias (the default) is fine
    c = make_cfg()
    with pytest.raises(ValueError, match="LoRA"):
        Learner(c.model, c.learner, c.algorithm).export_base_weights(str(tmp_path))


def test_save_pretrained_with_lora_leaves_training_untouched(tmp_path):
    """The merged checkpoint loads to the policy's function, and the optimizer still owns the adapters."""
    from model import HybridForCausalLM

    c = make_cfg("learner.lora.enabled=true", "learner.lora.r=4")
    learner = Learner(c.model, c.learner, c.algorithm)
    learner.train_step(batches_for(learner, c, make_group(seed=0)))
    policy, trainable = learner.policy, [p for p in learner.policy.parameters() if p.requires_grad]
    out = learner.save_pretrained(str(tmp_path / "ckpt"))
    assert learner.policy is policy
    optimized = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert trainable and all(id(p) in optimized for p in trainable)
    ids = torch.randint(1, 128, (1, 12))
    with torch.no_grad():
        expected = learner.policy(input_ids=ids).logits
        loaded = HybridForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
