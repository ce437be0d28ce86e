"""Recurrent KDA for decoding: one or a few tokens per sequence, state read and written by index.

Each program owns one (sequence, head, BV value columns) slice of the state in registers and walks the
sequence's tokens with the spec's recurrence (naive.py): decay, delta-rule write, read-out. With
`state_indices`, `initial_state` is a pool of states [P, H, K, V] (a rollout engine's cache) and
sequence n reads and overwrites slot state_indices[n] in place; a negative index marks a padded entry,
whose outputs are zero and whose state is untouched. No backward: this path is for inference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.naive import _check_inputs, check_gate
from kernels.kda.triton.common import G_MIN, block_size, debug_enabled, rsum


@triton.jit
def _decode_kernel(
    q, k, v, g, beta, o, h_in, h_out, state_indices, cu_seqlens, scale, stride_slot, T, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, HAS_IDX: tl.constexpr, STORE_HT: tl.constexpr,
    VARLEN: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)  # int64 token rows: t * H * K can pass 2^31
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:  # T tokens per sequence (a decode step: 1): no offsets tensor to build per call
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    slot = i_n.to(tl.int64)
    if HAS_IDX:
        slot = tl.load(state_indices + i_n).to(tl.int64)
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    live_v = (slot + 0 * rv) >= 0  # a vector: the interpreter rejects scalar masks
    kv_off = tl.maximum(slot, 0) * stride_slot + i_h * K * V + rk[:, None] * V + rv[None, :]
    kv_mask = mk[:, None] & (mv & live_v)[None, :]
    h = tl.full([BK, BV], 0.0, tl.float32)
    if HAS_H0:
        h += tl.load(h_in + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        base_k = (t * H + i_h) * K
        q_t = tl.load(q + base_k + rk, mask=mk, other=0.0).to(tl.float32) * scale
        k_t = tl.load(k + base_k + rk, mask=mk, other=0.0).to(tl.float32)
        g_t = tl.load(g + base_k + rk, mask=mk, other=0.0).to(tl.float32)
        v_t = tl.load(v + (t * H + i_h) * V + rv, mask=mv, other=0.0).to(tl.float32)
        b_t = tl.load(beta + t * H + i_h).to(tl.float32)
        h = h * tl.exp(g_t)[:, None]
        resid = v_t - rsum(k_t[:, None] * h, 0)
        h += (b_t * k_t)[:, None] * resid[None, :]
        o_t = tl.where(live_v, rsum(q_t[:, None] * h, 0), 0.0)
        tl.store(o + (t * H + i_h) * V + rv, o_t.to(o.dtype.element_ty), mask=mv)
    if STORE_HT:
        tl.store(h_out + kv_off, h, mask=kv_mask)


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA. Without `state_indices` it matches `naive_recurrent_kda` (state [N, H, K, V]).

    With `state_indices` [N] (int), `initial_state` is a pool [P, H, K, V] (fp32) that is updated in
    place, and the pool itself is returned as the final state. `out_dtype`: the output's dtype (default
    q's), rounded from the kernel's fp32 on store.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if state_indices is None:
        N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    else:
        N = _check_inputs(q, k, v, g, beta, None, cu_seqlens)
        if initial_state is None or not slot_contiguous_fp32(initial_state):
            raise ValueError(
                "state_indices needs initial_state: an fp32 pool [P, H, K, V] whose slots are each contiguous"
            )
        if tuple(initial_state.shape[1:]) != (H, K, V):
            raise ValueError(f"state pool must be [P, {H}, {K}, {V}], got {tuple(initial_state.shape)}")
        if state_indices.shape != (N,):
            raise ValueError(
                f"state_indices must have one entry per sequence ({N}), got {tuple(state_indices.shape)}"
            )
    if debug_enabled():
        check_gate(g, G_MIN)
    scale = K**-0.5 if scale is None else float(scale)
    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.int32)
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    o = torch.empty(B * T, H, V, device=q.device, dtype=out_dtype or q.dtype)
    if state_indices is not None:
        h_in = h_out = initial_state
        store_ht = True
    else:
        h_in = initial_state.to(torch.float32).contiguous() if initial_state is not None else o
        store_ht = output_final_state
        h_out = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if store_ht else o
    BK, BV = block_size(K), min(block_size(V), 32)
    # int32 or int64 slots on q's device as given (the kernel widens them): a conversion is a launch per layer
    idx = o  # not read without state_indices, as cu_seqlens is not without VARLEN
    if state_indices is not None:
        idx = state_indices.to(q.device, None if state_indices.dtype in (torch.int32, torch.int64) else torch.long)
    stride_slot = h_in.stride(0) if state_indices is not None else H * K * V
    _decode_kernel[(triton.cdiv(V, BV), N * H)](
        *flat, o, h_in, h_out, idx, o if cu is None else cu, scale, stride_slot, T, H, K, V, BK=BK, BV=BV,
        HAS_H0=initial_state is not None, HAS_IDX=state_indices is not None, STORE_HT=store_ht, VARLEN=cu is not None,
    )  # fmt: skip
    final = h_out if (store_ht and (output_final_state or state_indices is not None)) else None
    return o.view(B, T, H, V), final


def slot_contiguous_fp32(pool: torch.Tensor) -> bool:
    """True if the kernel can step `pool` [P, H, K, V] in place: fp32, each slot's [H, K, V] contiguous
    (the slot stride is free: vLLM's state views share their pages with the conv states)."""
    K, V = pool.shape[2:]
    return pool.dtype == torch.float32 and tuple(pool.stride()[1:]) == (K * V, V, 1)


@torch.no_grad()
def pool_decode_step_triton(q, k, v, g, beta, pool_PHKV, slots_N, scale=None, out_dtype=None) -> torch.Tensor:
    """`kernels.kda.kda_decode_step_` on the Triton step kernel: q, k, g [N, H, K] (one token) or
    [N, T, H, K] (T tokens each), v, beta likewise, states in `pool_PHKV` at `slots_N`, in place.

    An fp32 pool whose slots are each contiguous is stepped in place by index: no gather, no scatter,
    no device sync. Any other pool (another dtype, a layout with strided slots) is gathered, stepped and
    scattered back. Negative slots (vLLM's PAD_SLOT_ID) get a zero output and touch no state. No slot
    validation (it would sync the device): that is the caller's.
    """
    single = q.dim() == 3
    if single:
        q, k, v, g, beta = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
    if slot_contiguous_fp32(pool_PHKV):
        o, _ = fused_recurrent_kda_triton(q, k, v, g, beta, scale, pool_PHKV, True, None, slots_N, out_dtype)
    else:
        live_N = slots_N >= 0
        slots = slots_N[live_N].long()
        o_live, S_LHKV = fused_recurrent_kda_triton(
            *(t[live_N] for t in (q, k, v, g, beta)), scale, pool_PHKV[slots].float(), True, out_dtype=out_dtype
        )
        pool_PHKV[slots] = S_LHKV.to(pool_PHKV.dtype)
        o = torch.zeros_like(v, dtype=out_dtype or v.dtype)
        o[live_N] = o_live
    return o[:, 0] if single else o
