"""Shared cases for the KDA tests: fla-style random inputs, forward+backward runs, tolerances."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.testing import assert_close

H, K, V = 2, 32, 16

# Per-tensor RMS error ratios. fp32 measures ~1e-6; bf16 is dominated by rounding of the
# bf16 output and gradients (2^-9 relative), measured ~2e-3.
TOL = {
    torch.float64: dict.fromkeys(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), 1e-12),
    torch.float32: dict.fromkeys(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), 1e-5),
    torch.bfloat16: {
        "o": 6e-3,
        "ht": 1e-5,
        "dq": 8e-3,
        "dk": 8e-3,
        "dv": 8e-3,
        "dg": 8e-3,
        "dbeta": 8e-3,
        "dh0": 6e-3,
    },
}


def make_inputs(
    B: int, T: int, dtype: torch.dtype, seed: int = 0, g_lo: float = -5.0
) -> dict[str, torch.Tensor]:
    """Inputs like flash-linear-attention's tests: unit q and k, sigmoid beta, log-sigmoid g in [g_lo, 0]."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": F.normalize(randn(B, T, H, K), dim=-1).to(dtype),
        "k": F.normalize(randn(B, T, H, K), dim=-1).to(dtype),
        "v": randn(B, T, H, V).to(dtype),
        "g": F.logsigmoid(2 * randn(B, T, H, K)).clamp(min=g_lo).to(dtype),
        "beta": torch.sigmoid(randn(B, T, H)).to(dtype),
    }


def run_with_grads(fn, inputs, h0, cu_seqlens=None, compute_dtype=None, seed=1):
    """Forward + backward of a random linear functional of (o, final state); returns tensors by name."""
    compute_dtype = compute_dtype or inputs["q"].dtype
    leaves = {n: x.detach().to(compute_dtype).requires_grad_() for n, x in inputs.items()}
    h0_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    h0_leaf = h0.detach().to(h0_dtype).requires_grad_()
    o, ht = fn(**leaves, initial_state=h0_leaf, output_final_state=True, cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.dtype)
    ((o * do).sum() + (ht * dht).sum()).backward()
    out = {"o": o, "ht": ht, "dh0": h0_leaf.grad}
    out.update({f"d{n}": x.grad for n, x in leaves.items()})
    return out


def compare(ref, out, dtype, label):
    for name, tol in TOL[dtype].items():
        assert_close(f"{label} {name}", ref[name], out[name], tol)
