"""The launch-saving rewrites of the MoE's element-wise work against their references, forward and
backward: ``kernels.moe.combine`` (the weighted slot sum as one autograd node), ``permute``'s gathered
backward (instead of a scatter-add), the fp32 router under autocast, RMSNorm and the L2 norm through
F.rms_norm; and the op counts of bench/op_counts.py that they cut.

Token counts 1, 15, 64, 65 and 300 (the varlen lengths of the other model tests, here as T). fp32
tolerance: rtol 1e-6 / atol 1e-6 (summation order only); bf16: against an fp64 truth, the rewrite's
error at most the reference's plus a bf16 ulp of slack."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_cases import tiny_config

from kernels.moe import (
    combine,
    combine_reference,
    permute,
    permute_reference,
    route_layout,
    route_tensors,
)
from model.layers import RMSNorm, l2_normalize_fused, l2_normalize_reference, rms_norm, rms_norm_reference
from model.moe import MoEGate, routing_weights

TOKENS = [1, 15, 64, 65, 300]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "op_counts.py"


def _routing(T, k, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


def _grads(fn, *leaves, seed=1):
    out = fn()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(
        out.dtype
    )
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("align", [1, 8])
def test_combine_equals_the_unpermuted_weighted_sum_fp32(T, align):
    k, E, N = 4, 8, 24
    lay = route_layout(_routing(T, k, E, seed=T), E, align)
    y = torch.randn(lay.rows, N, requires_grad=True)
    w = torch.rand(T, k, requires_grad=True)
    got = _grads(lambda: combine(y, lay, w), y, w)
    ref = _grads(lambda: combine_reference(y, lay, w), y, w)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert float(got[1][~_used_rows(lay)].abs().sum()) == 0.0  # padding rows get no gradient


def _used_rows(lay):
    used = torch.zeros(lay.rows, dtype=torch.bool)
    used[lay.row_of_slot_S] = True
    return used


@pytest.mark.parametrize("T", [15, 300])
def test_combine_bf16_rows_fp32_weights_as_the_reference(T):
    """bf16 rows times fp32 weights: the product and sum in fp32 like the reference's upcast copy; the
    forward is the same ops (bit-equal), gradients to within a bf16 rounding."""
    k, E, N = 8, 16, 32
    lay = route_layout(_routing(T, k, E, seed=3), E, 8)
    y = torch.randn(lay.rows, N).bfloat16().requires_grad_()
    w = torch.rand(T, k).requires_grad_()
    got = _grads(lambda: combine(y, lay, w, torch.bfloat16), y, w)
    ref = _grads(lambda: combine_reference(y, lay, w, torch.bfloat16), y, w)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], ref[0])
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-5)


def test_combine_names_bad_weights():
    lay = route_layout(_routing(5, 2, 4), 4)
    with pytest.raises(ValueError, match=r"weights must be \[T, k\] = \[5, 2\]"):
        combine(torch.randn(lay.rows, 3), lay, torch.rand(5, 3))


@pytest.mark.parametrize("T", TOKENS)
def test_permute_backward_gathers_and_sums_the_slots(T):
    k, E, Z = 8, 16, 32
    lay = route_layout(_routing(T, k, E, seed=T), E, 8)
    z = torch.randn(T, Z, dtype=torch.float64, requires_grad=True)
    truth = _grads(lambda: permute_reference(z, lay), z)
    z32 = z.detach().float().requires_grad_()
    got, ref = _grads(lambda: permute(z32, lay), z32), _grads(lambda: permute_reference(z32, lay), z32)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-6)
    # bf16: one rounding of the fp32-accumulated sum instead of one per scatter-added row
    zb = z.detach().bfloat16().requires_grad_()
    gb, rb = _grads(lambda: permute(zb, lay), zb), _grads(lambda: permute_reference(zb, lay), zb)
    err = (gb[1].double() - truth[1]).abs().max()
    ref_err = (rb[1].double() - truth[1]).abs().max()
    assert err <= ref_err + 2**-8 * truth[1].abs().max()


def test_route_tensors_is_route_layout():
    experts = _routing(65, 8, 16, seed=2)
    lay = route_layout(experts, 16, 8)
    src, rows, offs = route_tensors(experts, 16, 8)
    assert (
        torch.equal(src, lay.src_row_P)
        and torch.equal(rows, lay.row_of_slot_S)
        and torch.equal(offs, lay.offs_E)
    )
    with pytest.raises(ValueError, match="align must be >= 1"):
        route_layout(experts, 16, 0)


def test_router_is_fp32_under_autocast():
    """Under bf16 autocast the router scores, the selection with its fp32 bias and the weights stay fp32
    (before: the linear ran in bf16 and the bias was rounded to bf16 before the top-k)."""
    torch.manual_seed(0)
    gate = MoEGate(tiny_config()).train()
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.randn(8) * 1e-3)
    x = torch.randn(300, 64).bfloat16()
    ref = gate(x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate(x)
    assert got.weights_TK.dtype == torch.float32
    assert torch.equal(got.experts_TK, ref.experts_TK)
    torch.testing.assert_close(got.weights_TK, ref.weights_TK, rtol=0, atol=0)


@pytest.mark.parametrize("renormalize, scaling", [(True, 1.0), (True, 2.5), (False, 1.0)])
def test_routing_weights_fold_the_scaling(renormalize, scaling):
    scores = torch.rand(15, 8, requires_grad=True)
    experts = _routing(15, 2, 8)
    w = routing_weights(scores, experts, renormalize, scaling)
    ref = scores.gather(-1, experts)
    ref = ref / ref.sum(-1, keepdim=True) if renormalize else ref
    torch.testing.assert_close(w, ref * scaling, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_op_by_op_reference(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(32)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(1, 445, 32).to(dtype).requires_grad_()
    got = _grads(lambda: rms_norm(x, norm.weight, 1e-5), x, norm.weight)
    ref = _grads(lambda: rms_norm_reference(x, norm.weight, 1e-5), x, norm.weight)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), **tol)



def test_moe_layer_ops_fwd_bwd(bench):
    """The gpu_1b structure at tiny widths, under CPU bf16 autocast, RMSNorm counted as CUDA runs it: the
    MoE has no scatter-add (the permute and combine backwards gather), no stack of expert weights (they are
    stacked parameters, ``GroupedExperts``), and fewer ops than before these rewrites (MoE 227, AttnRes mix
    53, RMSNorm 26; now 192, 25, 4)."""
    arch = bench.tiny_preset(bench.ROOT / "configs/model/gpu_1b.yaml")
    counts = bench.layer_op_counts(arch, TOKENS, bf16=True)
    moe = counts["moe"]["ops"]
    assert "index_add" not in moe and "scatter_add" in moe  # scatter_add: the router's gather backward
    assert "stack" not in moe
    assert counts["moe"]["total"] <= 192 and counts["attn_res"]["total"] <= 25
    assert counts["norm"]["ops"] == {"_fused_rms_norm": 2, "_fused_rms_norm_backward": 1, "ones_like": 1}
    assert {"dense_mlp", "attn_res", "moe", "mla", "norm", "model"} <= set(counts)


def test_op_counter_leaves_out_views_and_counts_rms_norm_as_fused(bench):
    x = torch.randn(4, 6, requires_grad=True)
    counter = bench.count_fwd_bwd(lambda: (x.view(24).t() * 2).sum(), [x], [])
    assert counter.ops["mul"] == 2 and "view" not in counter.ops and "t" not in counter.ops
    w = torch.randn(6, requires_grad=True)
    ref = _grads(lambda: torch.nn.functional.rms_norm(x, (6,), w, 1e-5), x, w)
    with bench.fused_rms_norm():
        got = _grads(lambda: torch.nn.functional.rms_norm(x, (6,), w, 1e-5), x, w)
        counter = bench.count_fwd_bwd(lambda: torch.nn.functional.rms_norm(x, (6,), w, 1e-5), [x], [w])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))  # the values are the real op's
    assert counter.ops == {"_fused_rms_norm": 1, "_fused_rms_norm_backward": 1, "ones_like": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_through_rms_norm_equals_the_reference(dtype):
    """x rsqrt(sum x^2 + eps) computed as D^-1/2 rms_norm(x; eps / D) (what CUDA runs), including rows
    far below eps."""
    torch.manual_seed(0)
    x = torch.randn(1, 445, 4, 16)
    x[0, :3] *= 1e-5  # sum x^2 ~ eps: the eps term matters
    x = x.to(dtype).requires_grad_()
    got = _grads(lambda: l2_normalize_fused(x, 1e-6), x)
    ref = _grads(lambda: l2_normalize_reference(x, 1e-6), x)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), **tol)
