"""Fused Triton SiTU-GLU (kernels/glu/triton.py) under TRITON_INTERPRET=1 against the PyTorch
reference and against model.layers.situ_glu, forward and backward: fp32 (error ratio <= 1e-6),
bf16 (<= 1e-2, the output's own rounding), strided gate/up views of one [R, 2C] buffer as the
grouped MoE path passes them, and shapes not a multiple of the kernel's blocks. ``GluActivation``'s
closed-form gradients against autograd on the references (float64 to 1e-12), and its fused form against
the kernels' autograd node bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.glu import GluActivation, silu_glu_reference, situ_glu_reference
from kernels.testing import assert_close, import_interpreted
from model.layers import situ_glu

triton = pytest.importorskip("triton")

_, GLU = import_interpreted("kernels.glu.jit", "kernels.glu.triton")


pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _grads(fn, gu, dh, *betas):
    gu = gu.detach().requires_grad_()
    g, u = gu.chunk(2, dim=-1)  # strided views, as the grouped path's gate/up halves
    h = fn(g, u, *betas)
    (dgu,) = torch.autograd.grad(h, gu, dh)
    return h.detach(), dgu


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("R, C, betas", [(37, 72, (4.0, 25.0)), (9, 300, (2.0, 5.0))])
def test_fused_situ_glu_matches_reference(dtype, tol, R, C, betas):
    torch.manual_seed(0)
    gu = (torch.randn(R, 2 * C) * 6).to(dtype)  # |g| past beta, |u| past linear_beta at the tails
    dh = torch.randn(R, C).to(dtype)
    h_ref, d_ref = _grads(situ_glu_reference, gu.double(), dh.double(), *betas)
    h, d = _grads(GLU.situ_glu_triton, gu, dh, *betas)
    assert h.dtype == dtype and d.dtype == dtype
    assert_close("h", h_ref, h.double(), tol)
    assert_close("dgu", d_ref, d.double(), tol)
    # the model's own SiTU-GLU (what the reference path runs) is the same function
    h_model, d_model = _grads(situ_glu, gu, dh, *betas)
    assert_close("h vs model", h_model.double(), h.double(), tol)
    assert_close("dgu vs model", d_model.double(), d.double(), tol)


def test_fused_situ_glu_fails_on_a_wrong_formula():
    """The comparison can fail: a kernel with the linear branch's beta swapped is caught."""
    torch.manual_seed(1)
    gu, dh = torch.randn(8, 64) * 6, torch.randn(8, 32)
    h_ref, _ = _grads(situ_glu_reference, gu, dh, 4.0, 25.0)
    h, _ = _grads(GLU.situ_glu_triton, gu, dh, 4.0, 5.0)
    with pytest.raises(AssertionError):
        assert_close("h", h_ref, h, 1e-6)


def test_fused_situ_glu_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="differ"):
        GLU.situ_glu_triton(torch.zeros(4, 8), torch.zeros(4, 9))


def test_kernel_bench_checks_every_variant_on_the_cpu(tmp_path):
    """bench/glu_kernel.py --small (interpreter, tiny shapes): each forward variant and inductor's compile of the
    reference agree with the fp64 reference to the bf16 output's rounding, and the report is written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "glu_kernel.py"
    subprocess.run([sys.executable, str(bench), "--small", "--out", str(tmp_path)], check=True, timeout=600)
    report = json.loads((tmp_path / "glu_kernel.json").read_text())
    for row in report["shapes"].values():
        assert set(row["error"]) == {"ours", "ours_compiled", "inductor"}
        assert all(e <= 1e-2 for e in row["error"].values())
        assert set(row["backward_call_us"]) == {"ours", "inductor"} and all(row["forward_call_us"].values())


def test_a_later_import_for_the_gpu_leaves_the_interpreted_ops_alone(monkeypatch):
    """The kernels' launches are custom ops; a second import of the module (a GPU process's, here without
    TRITON_INTERPRET) registers ops of its own name, so the interpreted module's calls still reach its
    interpreted launcher (under one name the dispatcher kept the last registration: Triton's real launcher
    on CPU tensors)."""
    import importlib
    import sys

    torch.manual_seed(2)
    g, u = torch.randn(5, 40), torch.randn(5, 40)
    want = GLU.situ_glu_triton(g, u)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delitem(sys.modules, "kernels.glu.triton")
    gpu_module = importlib.import_module("kernels.glu.triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_module is not GLU
    torch.testing.assert_close(GLU.situ_glu_triton(g, u), want, rtol=0, atol=0)


@pytest.mark.parametrize("act, betas", [("situ", (4.0, 25.0)), ("situ", (2.0, 5.0)), ("silu", ())])
def test_closed_form_gradients_equal_autograd_on_the_reference(act, betas):
    """What the grouped MoE's GLU node runs in backward: h bit for bit the reference's, the gradient in
    float64 equal to autograd's to rounding; bf16 inputs give bf16 gradients within one bf16 rounding of
    the float64 ones."""
    torch.manual_seed(3)
    gu, dh = torch.randn(23, 2 * 40, dtype=torch.float64) * 6, torch.randn(23, 40, dtype=torch.float64)
    ref = situ_glu_reference if act == "situ" else silu_glu_reference
    h_ref, d_ref = _grads(ref, gu, dh, *betas)
    glu = GluActivation(act, *betas)
    g, u = gu.chunk(2, dim=-1)
    h, dg, du = glu.values_and_grad(g, u, dh)
    assert torch.equal(h, h_ref) and torch.equal(glu.values(g, u), h_ref)
    assert_close("dgu float64", d_ref, torch.cat((dg, du), -1), 1e-12)
    g16, u16 = gu.bfloat16().chunk(2, dim=-1)
    h16, dg, du = glu.values_and_grad(g16, u16, dh.bfloat16())
    assert h16.dtype == dg.dtype == du.dtype == torch.bfloat16
    assert torch.equal(h16, ref(g16, u16, *betas))
    _, d_exact = _grads(ref, gu.bfloat16().double(), dh.bfloat16().double(), *betas)
    assert_close("dgu bf16", d_exact, torch.cat((dg, du), -1).double(), 8e-3)


def test_closed_form_gradient_fails_on_a_wrong_formula():
    """The float64 comparison can fail: SiTU's gradient with the betas swapped is caught."""
    torch.manual_seed(4)
    gu, dh = torch.randn(8, 64, dtype=torch.float64) * 6, torch.randn(8, 32, dtype=torch.float64)
    _, d_ref = _grads(situ_glu_reference, gu, dh, 4.0, 25.0)
    g, u = gu.chunk(2, dim=-1)
    _, dg, du = GluActivation("situ", 25.0, 4.0).values_and_grad(g, u, dh)
    with pytest.raises(AssertionError):
        assert_close("dgu", d_ref, torch.cat((dg, du), -1), 1e-6)


def test_fused_activation_is_the_kernels_node_bit_for_bit():
    """``GluActivation(fused=True)`` calls the kernels the autograd node calls: same h, same (dg, du)."""
    torch.manual_seed(5)
    gu, dh = (torch.randn(19, 2 * 72) * 6).bfloat16(), torch.randn(19, 72).bfloat16()
    h_node, d_node = _grads(GLU.situ_glu_triton, gu, dh, 4.0, 25.0)
    glu = GluActivation("situ", 4.0, 25.0, fused=True)
    g, u = gu.chunk(2, dim=-1)
    h, dg, du = glu.values_and_grad(g, u, dh)
    assert torch.equal(glu.values(g, u), h_node) and torch.equal(h, h_node)
    assert torch.equal(torch.cat((dg, du), -1), d_node)


def test_an_unknown_or_unfused_activation_is_refused():
    with pytest.raises(ValueError, match="'situ' or 'silu'"):
        GluActivation("gelu")
    with pytest.raises(ValueError, match="SiTU-GLU only"):
        GluActivation("silu", fused=True)
