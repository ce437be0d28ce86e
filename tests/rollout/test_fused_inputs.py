"""The engine's fused input GEMMs (``model.serving.fuse_feed_forward_inputs``): a dense GLU's gate and up,
and a latent MoE's down projection with its shared expert's gate and up, each as one GEMM of x. The outputs
equal the unfused modules', and the named weights stay views of the fused one, so an in-place weight update
(what ``load_weights`` and adapter folds do) reaches the fused product."""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_cases import TINY

from model.config import HybridConfig
from model.layers import GLUMLP
from model.modeling import HybridForCausalLM
from model.moe import SparseMoE
from model.serving import fuse_feed_forward_inputs, prepare_for_serving


def tiny_config(**overrides) -> HybridConfig:
    return HybridConfig(**{**TINY, **overrides})


def _fused_pair(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    fused = copy.deepcopy(module).eval().requires_grad_(False)
    fuse_feed_forward_inputs(fused)
    return module.eval().requires_grad_(False), fused


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fused_inputs_equal_the_modules_and_follow_weight_updates(kind):
    torch.manual_seed(0)
    config = tiny_config(routed_expert_hidden_size=32, num_shared_experts=1)
    ref, fused = _fused_pair(GLUMLP(64, 96) if kind == "dense" else SparseMoE(config))
    x = torch.randn(1, 37, 64)
    run = (lambda m: m(x[0])) if kind == "dense" else (lambda m: m(x)[0])
    with torch.no_grad():
        assert (fused.gate_up_weight if kind == "dense" else fused.fused_input) is not None
        torch.testing.assert_close(run(fused), run(ref), rtol=1e-5, atol=1e-6)
        gate = fused.gate_proj if kind == "dense" else fused.shared_experts.gate_proj
        ref_gate = ref.gate_proj if kind == "dense" else ref.shared_experts.gate_proj
        new = torch.randn_like(gate.weight)
        gate.weight.copy_(new)  # an in-place update of a named weight lands in the fused one
        ref_gate.weight.copy_(new)
        torch.testing.assert_close(run(fused), run(ref), rtol=1e-5, atol=1e-6)


def test_unfusable_modules_keep_their_own_calls():
    config = tiny_config(routed_expert_hidden_size=32, num_shared_experts=0)
    moe = SparseMoE(config)
    fuse_feed_forward_inputs(moe)  # no shared expert: nothing to fuse the latent projection with
    assert moe.fused_input is None
    mlp = GLUMLP(64, 96)
    mlp.up_proj = torch.nn.Linear(64, 96, bias=True)  # a bias: not a plain projection
    fuse_feed_forward_inputs(mlp)
    assert mlp.gate_up_weight is None


def test_prepared_model_computes_what_the_model_does():
    """``prepare_for_serving``: eval, no gradients, every feed-forward block's inputs fused, the route layout
    counted over the largest step; the logits stay the model's."""
    from kernels.moe import COUNTING_LAYOUT_MAX
    from model.moe import GroupedExperts

    torch.manual_seed(0)
    config = tiny_config(routed_expert_hidden_size=32, num_shared_experts=1)
    model = HybridForCausalLM(config).eval()
    served = copy.deepcopy(model)
    prepare_for_serving(served, max_step_tokens=4096)
    assert not served.training and not any(p.requires_grad for p in served.parameters())
    layers = served.model.layers
    assert all((layer.block_sparse_moe.fused_input if layer.is_moe else layer.mlp.gate_up_weight) is not None
               for layer in layers)  # fmt: skip
    grouped = [m for m in served.modules() if isinstance(m, GroupedExperts)]
    assert grouped and all(m.counting_layout_max == max(COUNTING_LAYOUT_MAX, 4096 * config.num_experts_per_token
                                                        * m.num_experts) for m in grouped)  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (1, 29))
    with torch.no_grad():
        torch.testing.assert_close(served(ids)[0], model(ids)[0], rtol=1e-5, atol=1e-5)
