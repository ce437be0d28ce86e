"""The specification of Kimi Delta Attention (KDA): a token-by-token recurrence.

Per head, with per-channel log-decay g_t <= 0, the state S in R^{K x V} evolves as

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

written the way flash-linear-attention's ``naive_recurrent_kda`` does: decay first, then the
delta-rule write. It runs in float64 so that every faster path can be compared against it.
Shapes follow flash-linear-attention: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H],
state [N, H, K, V] with N = B, or N = len(cu_seqlens) - 1 for packed sequences (B = 1).
"""

from __future__ import annotations

import torch


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> int:
    """Validate shapes and return N, the number of sequences."""
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"q, k and g must share a shape, got q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}"
        )
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need B == 1, got B = {B}")
        if cu_seqlens.ndim != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
            raise ValueError(f"cu_seqlens must run from 0 to T = {T}, got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    V = v.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}"
        )
    return N


def check_gate(g: torch.Tensor, lower_bound: float) -> None:
    """Raise if any log-decay lies below the bound every chunked path relies on (a device sync on GPU,
    so the fast paths call it only in check mode)."""
    low = float(g.detach().min()) if g.numel() else 0.0
    if not low >= lower_bound:
        raise ValueError(
            f"KDA gate contract g >= {lower_bound} violated, min(g) = {low:.4g}: the 16-token diagonal "
            f"tiles would overflow (bound the decay, e.g. g = g_min * sigmoid(...), or pass lower_bound=)"
        )


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every sequence, in state order."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA, one token at a time, in float64. Differentiable (slowly).

    Returns o [B, T, H, V] in q's dtype and, if asked, the final state [N, H, K, V]
    (float32, or float64 for float64 inputs).
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    f64, in_dtype = torch.float64, q.dtype
    q, k, v, g, beta = (t.to(f64) for t in (q, k, v, g, beta))
    o_rows: list[list[torch.Tensor]] = [[] for _ in range(B)]
    finals = []
    for n, (b, start, end) in enumerate(sequence_bounds(B, T, cu_seqlens)):
        S_HKV = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].to(f64)
        for t in range(start, end):
            S_HKV = S_HKV * g[b, t].exp()[..., None]
            k_HK, v_HV = k[b, t], v[b, t]
            residual_HV = v_HV - torch.einsum("hk,hkv->hv", k_HK, S_HKV)
            S_HKV = S_HKV + torch.einsum("hk,hv->hkv", beta[b, t][:, None] * k_HK, residual_HV)
            o_rows[b].append(torch.einsum("hk,hkv->hv", q[b, t] * scale, S_HKV))
        finals.append(S_HKV)
    o = torch.stack([torch.stack(rows) if rows else q.new_zeros(0, H, V) for rows in o_rows]).to(in_dtype)
    state_dtype = f64 if in_dtype == f64 else torch.float32
    final_state = torch.stack(finals).to(state_dtype) if output_final_state else None
    return o, final_state
