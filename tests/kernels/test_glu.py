"""Fused Triton SiTU-GLU (kernels/glu/triton.py) under TRITON_INTERPRET=1 against the PyTorch
reference and against model.layers.situ_glu, forward and backward: fp32 (error ratio <= 1e-6),
bf16 (<= 1e-2, the output's own rounding), strided gate/up views of one [R, 2C] buffer as the
grouped MoE path passes them, and shapes not a multiple of the kernel's blocks."""

from __future__ import annotations

import pytest
import torch

from kernels.glu import situ_glu_reference
from kernels.testing import assert_close, import_interpreted
from model.layers import situ_glu

triton = pytest.importorskip("triton")

(GLU,) = import_interpreted("kernels.glu.triton")


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
