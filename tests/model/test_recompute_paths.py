"""The memory-saving "recompute" fast paths (model.fast ops "glu", "attn_res", "norm"; the grouped MoE's
weighted slot sum is kernels.moe.combine on both sides): the same outputs and gradients as autograd on the reference ops, bit for bit, and
fewer bytes kept for backward (counted with saved_tensors_hooks). Also the MoE's and the MLA's one cast of
their input under autocast, against a cast per projection."""

from __future__ import annotations

import copy

import pytest
import torch
from model_cases import tiny_config

from kernels.testing import error_ratio
from model.attnres import AttnResMix
from model.fast import use_fast_paths
from model.layers import GLUMLP, RMSNorm, l2_normalize, seq_layout
from model.mla import GatedMLA
from model.modeling import HybridForCausalLM
from model.moe import SparseMoE


def saved_bytes(fn) -> tuple[object, int]:
    """fn()'s result and the bytes of distinct storages autograd saved while it ran."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def run_and_grad(fn, inputs, params):
    out, nbytes = saved_bytes(fn)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, [*inputs, *params], g)
    return out.detach(), grads, nbytes


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_recompute_equals_autograd_and_keeps_less(act, dtype):
    torch.manual_seed(0)
    mlp = GLUMLP(16, 48, act)
    gu = (torch.randn(40, 96) * 5).to(dtype).requires_grad_()
    results = {}
    for choice in ("torch", "recompute"):
        with use_fast_paths("auto", glu=choice):
            results[choice] = run_and_grad(lambda: mlp.glu(*gu.chunk(2, dim=-1)), [gu], [])
    (out_ref, g_ref, bytes_ref), (out, g, nbytes) = results["torch"], results["recompute"]
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert nbytes <= gu.numel() * gu.element_size() < bytes_ref  # only gate/up (one buffer) kept


def test_attn_res_recompute_equals_autograd_and_keeps_less():
    torch.manual_seed(0)
    mix = AttnResMix(32)
    torch.nn.init.normal_(mix.query)
    torch.nn.init.normal_(mix.norm.weight)
    sources = [torch.randn(1, 20, 32, requires_grad=True) for _ in range(4)]
    params = [mix.query, mix.norm.weight]
    results = {}
    for choice in ("torch", "recompute"):
        with use_fast_paths("auto", attn_res=choice):
            results[choice] = run_and_grad(lambda: mix(sources), sources, params)
    (out_ref, g_ref, bytes_ref), (out, g, nbytes) = results["torch"], results["recompute"]
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    # only the sources and weights themselves (alive anyway), not the stack and norm copies
    kept = sum(t.numel() * t.element_size() for t in [*sources, *params])
    assert nbytes <= kept and sum(s.numel() * s.element_size() for s in sources) < bytes_ref


@pytest.mark.parametrize("which", ["rms", "l2"])
def test_norm_recompute_equals_autograd_and_keeps_less(which):
    torch.manual_seed(0)
    norm = RMSNorm(32)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 20, 32).to(torch.bfloat16).requires_grad_()
    params = [norm.weight] if which == "rms" else []
    fn = (lambda: norm(x)) if which == "rms" else (lambda: l2_normalize(x))
    results = {}
    for choice in ("torch", "recompute"):
        with use_fast_paths("auto", norm=choice):
            results[choice] = run_and_grad(fn, [x], params)
    (out_ref, g_ref, bytes_ref), (out, g, nbytes) = results["torch"], results["recompute"]
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    kept = sum(t.numel() * t.element_size() for t in [x, *params])  # x and the weight (alive anyway)
    assert nbytes <= kept and x.numel() * x.element_size() < bytes_ref


def test_model_step_equals_the_reference_ops_and_keeps_less():
    """Whole model, packed varlen, grouped MoE: default (recompute) paths vs autograd on the same ops, bit for bit;
    "fused" (each mix and the norm after it as one node, its gradient in closed form) as accurate as autograd:
    each of its gradients within 2x autograd's own error (+ 2e-6) of the same model's float64 gradient,
    relative to the gradient's norm. Against float64, not against autograd's fp32 digits: a KDA layer's
    ``A_log`` gradient (2 heads, sums with cancellation) is 2.4e-5 off float64 on either path, so the two
    fp32 paths differ there by ~1e-5 depending on the CPU (1.1e-5 on one CI machine; worst ratio to
    autograd's error measured 1.3)."""
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config(routed_expert_hidden_size=32)).train()
    lengths = [1, 15, 64, 65]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.randint(0, 128, (1, sum(lengths)))

    def grads(m: HybridForCausalLM, choice: str):
        def step():
            return m(ids, cu_seqlens=cu, target_ids=ids.roll(-1, 1), return_logits=False).token_logprobs

        glu_norm = "recompute" if choice == "fused" else choice
        with use_fast_paths("auto", moe="grouped", glu=glu_norm, attn_res=choice, norm=glu_norm):
            return run_and_grad(step, [], [p for p in m.parameters() if p.requires_grad])

    results = {choice: grads(model, choice) for choice in ("torch", "recompute", "fused")}
    _, g64, _ = grads(copy.deepcopy(model).double(), "torch")
    out_ref, g_ref, bytes_ref = results["torch"]
    for choice in ("recompute", "fused"):
        out, g, _ = results[choice]
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        for a, b, truth in zip(g, g_ref, g64):
            if choice == "recompute":
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            else:
                assert error_ratio(truth, a.double()) <= 2 * error_ratio(truth, b.double()) + 2e-6
    assert results["recompute"][2] < 0.8 * bytes_ref
    assert results["fused"][2] < results["recompute"][2]  # the mixed input of each norm is not kept either


def _autocast_layer_run(layer: str):
    """(module, run): one forward of a tiny MoE or MLA layer under CPU bf16 autocast on a non-leaf fp32 input
    (autocast caches its cast of a leaf, so a leaf would share one cast in either form)."""
    config = tiny_config(routed_expert_hidden_size=32)
    module = SparseMoE(config) if layer == "moe" else GatedMLA(config, layer_idx=3)
    leaf = torch.randn(1, 40, config.hidden_size, requires_grad=True)
    layout = seq_layout(1, 40, None, leaf.device)

    def run(dtype=torch.float32):
        x = leaf.to(dtype) * 1.0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float64):
            return module(x)[0] if layer == "moe" else module(x, layout)[0]

    return module, leaf, run


@pytest.mark.parametrize("layer", ["moe", "mla"])
def test_moe_and_mla_cast_x_once_under_autocast(monkeypatch, layer):
    """Under bf16 autocast the MoE and the MLA cast their fp32 input once for all their projections (autocast
    keeps a copy per nn.Linear), and the MLA's gate product stays bf16 (no fp32 copy of the attention
    output). Against the per-Linear casts and the fp32 gate product (``compute_dtype`` patched to keep x's
    dtype): the same outputs and weight gradients bit for bit, two [T, D] bf16 copies fewer kept; the input
    gradient too for the MLA (each projection's gradient upcast on its own, ``cast_once``), while the MoE's
    shared expert adds its gate and up input gradients in bf16 (one GLUMLP call): as close to float64."""
    import model.layers as layers_mod

    module, leaf, run = _autocast_layer_run(layer)
    params = [p for p in module.parameters() if p.requires_grad]
    results = {"once": run_and_grad(run, [leaf], params)}
    with monkeypatch.context() as m:
        m.setattr(layers_mod, "compute_dtype", lambda t: t.dtype)
        results["per_linear"] = run_and_grad(run, [leaf], params)
    (out, g, nbytes), (out_ref, g_ref, bytes_ref) = results["once"], results["per_linear"]
    assert torch.equal(out, out_ref)
    assert all(torch.equal(a, b) for a, b in zip(g[1:], g_ref[1:]))
    assert nbytes <= bytes_ref - 2 * leaf.numel() * 2
    if layer == "mla":
        assert torch.equal(g[0], g_ref[0])
    else:
        module.double()
        exact = run_and_grad(lambda: run(torch.float64), [leaf], params)[1][0]
        assert error_ratio(exact, g[0]) <= 1.25 * error_ratio(exact, g_ref[0])
