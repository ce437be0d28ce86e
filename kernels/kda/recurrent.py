"""KDA step recurrence for decoding: a few tokens per sequence, state in fp32.

The same recurrence as ``naive_recurrent_kda`` (decay, then the delta-rule write), but
vectorised over sequences and heads and run in fp32 instead of float64, for generation
caches and rollout engines. ``kda_decode_step_`` reads and writes the states of a pool
[P, H, K, V] in place by slot index, the way vLLM keeps recurrent states per request.
Differentiable by autograd (out-of-place updates), though decoding rarely needs it.
"""

from __future__ import annotations

import torch

from kernels.kda.naive import _check_inputs


def _padded_steps(x_TH_: torch.Tensor, cu: torch.Tensor, L: int) -> torch.Tensor:
    """Packed [T, H, *] -> [L, N, H, *] by position in sequence; positions past the end are zero."""
    starts_N, lens_N = cu[:-1], cu[1:] - cu[:-1]
    pos_L1 = torch.arange(L)[:, None]
    src_LN = torch.where(pos_L1 < lens_N[None, :], starts_N[None, :] + pos_L1, x_TH_.shape[0])
    padded = torch.cat([x_TH_, x_TH_.new_zeros((1, *x_TH_.shape[1:]))])
    return padded[src_LN.to(x_TH_.device)]


def _step(S_NHKV, q_NHK, k_NHK, v_NHV, g_NHK, beta_NH1) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: decay, then the delta-rule write, then the read (q already scaled)."""
    S_NHKV = S_NHKV * g_NHK.exp()[..., None]
    residual_NHV = v_NHV - torch.einsum("nhk,nhkv->nhv", k_NHK, S_NHKV)
    S_NHKV = S_NHKV + (beta_NH1 * k_NHK)[..., None] * residual_NHV[..., None, :]
    return torch.einsum("nhk,nhkv->nhv", q_NHK, S_NHKV), S_NHKV


def fused_recurrent_kda(
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
    """KDA token by token in fp32, same signature and conventions as ``naive_recurrent_kda``.

    Cost is sequential in the longest sequence: meant for decoding, prefill uses chunk_kda.
    CUDA tensors without gradients run the Triton kernel (``fused_recurrent_kda_triton``).
    Padding steps of shorter sequences use g = 0, beta = 0, k = 0, which leaves a state as is.
    """
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)
    )
    if q.is_cuda and not grads:  # the Triton step kernel (it has no backward)
        from kernels.kda.triton import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens
        )
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu = (torch.arange(B + 1) * T) if cu_seqlens is None else cu_seqlens.to("cpu", torch.long)
    L = int((cu[1:] - cu[:-1]).max()) if N else 0

    def steps(x: torch.Tensor) -> torch.Tensor:
        return _padded_steps(x.reshape(B * T, H, x.shape[3] if x.dim() == 4 else 1).to(dt), cu, L)

    q_L, k_L, v_L, g_L = steps(q) * scale, steps(k), steps(v), steps(g)
    beta_L = steps(beta)  # [L, N, H, 1]
    S_NHKV = q.new_zeros((N, H, K, V), dtype=dt) if initial_state is None else initial_state.to(dt)
    o_steps = []
    for t in range(L):
        o_NHV, S_NHKV = _step(S_NHKV, q_L[t], k_L[t], v_L[t], g_L[t], beta_L[t])
        o_steps.append(o_NHV)
    o_LNHV = torch.stack(o_steps) if o_steps else q.new_zeros((0, N, H, V), dtype=dt)
    # Back to packed token order: token i of sequence n sits at (i, n).
    lens_N = cu[1:] - cu[:-1]
    seq_T = torch.repeat_interleave(torch.arange(N), lens_N)
    pos_T = torch.arange(B * T) - cu[:-1][seq_T]
    o = o_LNHV[pos_T.to(o_LNHV.device), seq_T.to(o_LNHV.device)].reshape(B, T, H, V).to(q.dtype)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return o, (S_NHKV.to(state_dtype) if output_final_state else None)


@torch.no_grad()
def kda_decode_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Advance N sequences whose states live in ``state_pool`` [P, H, K, V], in place.

    q, k, g [N, T, H, K], v [N, T, H, V], beta [N, T, H]: T new tokens for each of N
    sequences (or [N, H, K] etc. for one token each). ``state_indices`` [N] names each
    sequence's slot; a negative index is a padding entry (vLLM's PAD_SLOT_ID): its output is
    zero and no slot is touched. Returns o shaped like v, in ``out_dtype`` (default v's): the rollout engine
    asks for its residual stream's dtype, which the output gate casts o to first, so a bf16 engine's decode
    and prefill give the gate the same dtype (one compiled gate, not two) and no cast is launched.

    CUDA tensors run the Triton step kernel (``kernels.kda.triton.pool_decode_step_triton``); there
    the slot checks (range, duplicates) would sync the device, so they run only in the debug mode
    (LONGHORIZON_KDA_DEBUG=1 or LONGHORIZON_KDA_CHECK=1). CPU tensors always check.
    """
    single = q.dim() == 3
    if single:
        q, k, v, g, beta = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
    N, _, H, K = q.shape
    P, V = state_pool.shape[0], v.shape[-1]
    if tuple(state_pool.shape[1:]) != (H, K, V):
        raise ValueError(
            f"state_pool must be [P, H, K, V] = [P, {H}, {K}, {V}], got {tuple(state_pool.shape)}"
        )
    if state_indices.numel() != N:
        raise ValueError(f"state_indices must hold one slot per sequence ({N}), got {state_indices.numel()}")
    if state_pool.is_cuda:  # the Triton step; slot checks sync the device, so only in the debug mode
        from kernels.kda.triton import pool_decode_step_triton
        from kernels.kda.triton.common import debug_enabled

        # int32 ids (vLLM's) go in as they are: the kernel widens them, a conversion would be a launch per layer
        idx_N = state_indices.to(state_pool.device).reshape(-1)
        if debug_enabled():
            _check_slots(idx_N.long(), P)
        o = pool_decode_step_triton(q, k, v, g, beta, state_pool, idx_N, scale, out_dtype)
        return o[:, 0] if single else o
    idx_N = state_indices.to(device=state_pool.device, dtype=torch.long).reshape(-1)
    valid_N = idx_N >= 0
    slots = _check_slots(idx_N, P)
    if single and slots.numel() == N:  # the rollout engine's decode: one token, no padding entries
        _check_inputs(q, k, v, g, beta, None, None)  # the generic path checks inside fused_recurrent_kda
        return _pool_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state_pool, slots, scale, out_dtype)
    o = torch.zeros_like(v, dtype=out_dtype or v.dtype)
    if slots.numel():
        sel = valid_N.to(q.device)
        o_sel, state = fused_recurrent_kda(
            q[sel], k[sel], v[sel], g[sel], beta[sel], scale, state_pool[slots], output_final_state=True
        )
        o[sel] = o_sel.to(o.dtype)
        state_pool[slots] = state.to(state_pool.dtype)
    return o[:, 0] if single else o


def _check_slots(idx_N: torch.Tensor, P: int) -> torch.Tensor:
    """The live slots of a decode step's state indices (negative: padding), each < P and named once."""
    slots = idx_N[idx_N >= 0]
    if bool((slots >= P).any()):
        raise ValueError(f"state_indices out of range for a pool of {P} slots: {idx_N.tolist()}")
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"state_indices name a slot twice: {idx_N.tolist()}")
    return slots


def _pool_step_(q_NHK, k_NHK, v_NHV, g_NHK, beta_NH, pool_PHKV, slots_N, scale, out_dtype=None) -> torch.Tensor:
    """One token per sequence straight on the gathered states: the generic path's padding and
    re-ordering cost about 1 ms per call, a fifth of a tiny model's decode step. o in ``out_dtype``
    (default v's), cast once from the step's precision."""
    K = q_NHK.shape[-1]
    dt = torch.float64 if q_NHK.dtype == torch.float64 else torch.float32
    scale = K**-0.5 if scale is None else scale
    o_NHV, S_NHKV = _step(
        pool_PHKV[slots_N].to(dt),
        q_NHK.to(dt) * scale,
        k_NHK.to(dt),
        v_NHV.to(dt),
        g_NHK.to(dt),
        beta_NH.to(dt)[..., None],
    )
    pool_PHKV[slots_N] = S_NHKV.to(pool_PHKV.dtype)
    return o_NHV.to(out_dtype or v_NHV.dtype)
