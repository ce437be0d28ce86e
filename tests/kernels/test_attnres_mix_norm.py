"""The engine's AttnRes mix + RMSNorm kernel (``kernels.attnres``) against the model's reference ops."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import assert_close, assert_within_ulps, import_interpreted
from model.attnres import attn_res_mix_stacked
from model.layers import rms_norm


def _interpreted():
    pytest.importorskip("triton")
    return import_interpreted("kernels.attnres.triton")[0]


def _reference(q, kw, eps, ow, out_eps, v):
    return rms_norm(attn_res_mix_stacked(q, kw, eps, v), ow, out_eps)


@pytest.mark.parametrize("S", [1, 2, 3, 6])
@pytest.mark.parametrize("D", [64, 48])  # a power of two; a row narrower than its block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_norm_kernel_equals_the_mix_then_the_norm(monkeypatch, S, D, dtype):
    """Sources of different scales (the softmax far from uniform), a query that is not zero, [S, B, T, D]. fp32:
    within 1e-6 (the softmax runs online, summed in another order); bf16: every element within 3 units of the
    last place (the interpreter rounds a bf16 cast toward zero, a GPU to nearest, and the mix is rounded to
    bf16 before the norm, then the output)."""
    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(S * 100 + D)
    v = (torch.randn(S, 2, 5, D, generator=gen) * torch.linspace(0.5, 4.0, S).view(S, 1, 1, 1)).to(dtype)
    q, kw, ow = (torch.randn(D, generator=gen) for _ in range(3))
    got = mod.mix_norm_rows(q, kw, 1e-5, ow, 1e-6, v)
    want = _reference(q, kw, 1e-5, ow, 1e-6, v)
    assert got.dtype == dtype and got.shape == (2, 5, D)
    if dtype == torch.float32:
        assert_close("mix + norm", want, got, 1e-6)
    else:
        assert_within_ulps("mix + norm", want, got, 3)


def test_mix_norm_kernel_names_bad_shapes(monkeypatch):
    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"sources \[S >= 1, \.\.\., D\] and weights \[D\]"):
        mod.mix_norm_rows(torch.zeros(8), torch.zeros(8), 1e-5, torch.zeros(4), 1e-5, torch.zeros(2, 3, 8))
