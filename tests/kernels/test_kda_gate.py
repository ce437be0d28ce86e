"""Why the decay is bounded: saturated-gate stress tests and the dense-tile overflow they avoid."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kda_cases import H, K, V, compare, make_inputs, run_with_grads

from kernels.kda import chunk_kda, naive_recurrent_kda
from kernels.kda.chunk import CHECK_ENV, dense_chunk_scores, intra_chunk_scores
from kernels.testing import assert_close, nan_poisoned_empty

G_MIN = -5.0


def bounded_gate(z: torch.Tensor) -> torch.Tensor:
    """The model's default gate with A = 0: g = g_min * sigmoid(z), in (g_min, 0)."""
    return G_MIN * torch.sigmoid(z)


def unbounded_gate(z: torch.Tensor, A: float = 0.0) -> torch.Tensor:
    """Kimi Linear's gate: g = -exp(A) * softplus(z), unbounded below."""
    return -torch.exp(torch.tensor(A)) * F.softplus(z)


def pairwise_scores(a_CK: torch.Tensor, k_CK: torch.Tensor, G_CK: torch.Tensor) -> torch.Tensor:
    """sum_c a_rc k_jc exp(G_rc - G_jc) for j <= r in float64, one exponent per pair: always safe."""
    a, k, G = a_CK.double(), k_CK.double(), G_CK.double()
    C = G.shape[-2]
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool))
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    return torch.einsum("...rc,...jc,...rjc->...rj", a, k, diff.exp())


def chunk_of(g_value_or_tensor, C: int, dtype: torch.dtype, seed: int = 0):
    x = make_inputs(1, C, torch.float64, seed=seed)
    q, k = x["q"][0, :, 0], x["k"][0, :, 0]  # [C, K]
    g = g_value_or_tensor if torch.is_tensor(g_value_or_tensor) else torch.full((C, K), g_value_or_tensor)
    G = g.double().cumsum(0)
    return q.to(dtype), k.to(dtype), G.to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_at_bound_64_token_dense_tile_overflows_16_token_tiles_do_not(dtype):
    """At g = g_min a 64-token chunk spans 320 nats: one dense tile is not finite, 16-token sub-tiles are."""
    q, k, G = chunk_of(bounded_gate(torch.full((64, K), 30.0)), 64, dtype)
    assert float(G[-1].min()) == pytest.approx(64 * G_MIN)
    dense = dense_chunk_scores(q, k, G)
    assert not torch.isfinite(torch.tril(dense)).all(), "the whole-chunk dense tile should overflow"
    # A plain dense tile over 16 tokens (80 nats at the bound) is still finite: the sub-tile size is legal.
    assert torch.isfinite(dense_chunk_scores(q[:16], k[:16], G[:16])).all()
    (A,) = intra_chunk_scores((q,), k, G)
    assert_close(
        f"sub-tiled scores at the bound {dtype}",
        pairwise_scores(q, k, G),
        A,
        2e-2 if dtype == torch.bfloat16 else 1e-5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unbounded_gate_past_the_bound_breaks_dense_tiles(dtype):
    """An unbounded gate driven to g ~ -8 overflows even a 16-token dense tile (128 nats).

    The midpoint shift keeps each factor within 8 tokens (64 nats), so the sub-tiled scores stay
    finite and right; this is headroom, not the contract (past g ~ -11 they overflow too).
    """
    g = unbounded_gate(torch.full((64, K), 8.0))
    assert float(g.min()) < -7.9
    q, k, G = chunk_of(g, 64, dtype, seed=1)
    assert not torch.isfinite(torch.tril(dense_chunk_scores(q[:16], k[:16], G[:16]))).all()
    (A,) = intra_chunk_scores((q,), k, G)
    assert_close(
        f"sub-tiled scores at g=-8 {dtype}",
        pairwise_scores(q, k, G),
        A,
        2e-2 if dtype == torch.bfloat16 else 1e-5,
    )


def test_chunk_kda_with_unbounded_gate_headroom_and_limit():
    """End to end: at g ~ -8 (past the bound) chunk_kda is still right; at g ~ -20 it is not finite.

    The recurrence itself is fine at any g <= 0; only the factored tiles need the bound.
    """
    x = make_inputs(1, 130, torch.float32, seed=8)
    o_ref, _ = naive_recurrent_kda(
        **{n: t.double() for n, t in {**x, "g": unbounded_gate(torch.full_like(x["g"], 8.0))}.items()}
    )
    o, _ = chunk_kda(**{**x, "g": unbounded_gate(torch.full_like(x["g"], 8.0))})
    assert_close("unbounded g=-8", o_ref, o, 1e-5)
    o_far, _ = chunk_kda(**{**x, "g": unbounded_gate(torch.full_like(x["g"], 20.0))})
    assert not torch.isfinite(o_far).all(), "16-token tiles at 160 nats per factor should overflow"


@pytest.mark.parametrize("T", [2048])
def test_bf16_saturated_gate_thousands_of_tokens(T):
    """bf16, gate saturated at g_min on every channel for thousands of tokens: finite and correct,
    forward and backward (the gate's own gradient included)."""
    x = make_inputs(1, T, torch.bfloat16, seed=5)
    x["g"] = bounded_gate(torch.full((1, T, H, K), 40.0)).to(torch.bfloat16)
    assert float(x["g"].min()) == G_MIN
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(6))
    ref = run_with_grads(naive_recurrent_kda, x, h0, compute_dtype=torch.float64)
    out = run_with_grads(chunk_kda, x, h0)
    compare(ref, out, torch.bfloat16, f"saturated bf16 T={T}")


def test_bf16_mixed_saturated_and_slow_channels():
    """Half the channels at g_min, half barely decaying: long memory and fast decay in one state."""
    T = 1024
    x = make_inputs(1, T, torch.bfloat16, seed=6)
    z = torch.where(torch.arange(K) % 2 == 0, 40.0, -8.0).expand(1, T, H, K)
    x["g"] = bounded_gate(z).to(torch.bfloat16)
    o, ht = chunk_kda(**x, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    assert_close("mixed bf16 o", o_ref, o, 6e-3)
    assert_close("mixed bf16 state", ht_ref, ht, 1e-5)


def test_check_mode_enforces_the_contract(monkeypatch):
    x = make_inputs(1, 20, torch.float32, seed=7)
    x_bad = {**x, "g": x["g"].clone()}
    x_bad["g"][0, 3, 1, 5] = -7.25
    chunk_kda(**x_bad)  # unchecked by default: the contract is the caller's
    monkeypatch.setenv(CHECK_ENV, "1")
    chunk_kda(**x)
    with pytest.raises(ValueError, match=r"min\(g\) = -7.25"):
        chunk_kda(**x_bad)
    chunk_kda(**x_bad, lower_bound=-8.0)


def test_nan_poisoning_is_active_for_kernels_code():
    scope = {"__name__": "kernels.fake", "torch": torch}
    exec(
        "def alloc():\n    return torch.empty(4), torch.empty_like(torch.ones(2)), torch.ones(1).new_empty(3)",
        scope,
    )
    for t in scope["alloc"]():
        assert torch.isnan(t).all()
    with nan_poisoned_empty(only_prefixes=None):
        assert torch.isnan(torch.empty(2, 2)).all()
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close("poisoned", torch.ones(2), torch.tensor([1.0, float("nan")]), 1.0)
