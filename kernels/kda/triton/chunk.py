"""`chunk_kda_triton`: the autograd Function over the Triton forward (fwd.py) and backward (bwd.py).

Same signature and conventions as `kernels.kda.naive_recurrent_kda` (flash-linear-attention's layout):
q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], state [N, H, K, V] in fp32, B = 1 with
cu_seqlens. Contract: g >= G_MIN = -5 (the bounded gate); with LONGHORIZON_KDA_DEBUG=1 or
LONGHORIZON_KDA_CHECK=1 (the CPU path's switch) it is checked (a device sync).
Differences from the peer: no GQA/GVA head ratios (the model uses equal head counts), no gate or L2 norm
fused in; the per-chunk states and Vn of the forward are kept for the backward instead of recomputed.
"""

from __future__ import annotations

import torch

from kernels.kda.naive import _check_inputs, check_gate
from kernels.kda.triton.bwd import kda_bwd
from kernels.kda.triton.common import G_MIN, debug_enabled, plan_chunks
from kernels.kda.triton.fwd import kda_fwd

_SAVED = ("G", "Aqk", "Ainv", "W", "Hc", "Vn", "Qg", "Kd")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        B, T, H = q.shape[:3]
        plan = plan_chunks(B, T, cu_seqlens, q.device)
        h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
        flat = [_flat(x) for x in (q, k, v, g, beta)]
        out = kda_fwd(*flat, scale, h0, plan, store_ht=output_final_state)
        ctx.save_for_backward(*flat, h0, *(out[name] for name in _SAVED))
        ctx.plan, ctx.scale, ctx.shape = plan, scale, (B, T)
        ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)
        o = out["o"].view(B, T, H, v.shape[-1])
        return o, out["ht"]

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, *rest = ctx.saved_tensors
        saved = dict(zip(_SAVED, rest, strict=True))
        B, T = ctx.shape
        do = torch.zeros(*v.shape, device=v.device, dtype=v.dtype) if do is None else _flat(do)
        dht = None if dht is None else dht.to(torch.float32).contiguous()
        dq, dk, dv, dg, dbeta, dh0 = kda_bwd(q, k, v, g, beta, ctx.scale, h0, ctx.plan, saved, do, dht)
        unflat = lambda x: x.view(B, T, *x.shape[1:])
        dh0 = None if dh0 is None else dh0.to(ctx.h0_dtype)
        return unflat(dq), unflat(dk), unflat(dv), unflat(dg), unflat(dbeta), None, dh0, None, None


def chunk_kda_triton(
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
    """Chunked KDA on CUDA (or under TRITON_INTERPRET=1). Returns (o [B, T, H, V], final state | None)."""
    # cu_seqlens is validated by the (cached) chunk plan: no device sync per call once it is known
    _check_inputs(q, k, v, g, beta, None, None)
    plan = plan_chunks(q.shape[0], q.shape[1], cu_seqlens, q.device)
    H, N = q.shape[2], plan.num_seqs
    if initial_state is not None and tuple(initial_state.shape) != (N, H, q.shape[-1], v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{N}, {H}, {q.shape[-1]}, {v.shape[-1]}], "
            f"got {tuple(initial_state.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    K, V = q.shape[-1], v.shape[-1]
    if K > 256 or V > 256:
        raise ValueError(f"head dims up to 256 are supported, got K = {K}, V = {V}")
    if debug_enabled():
        check_gate(g, G_MIN)
    scale = K**-0.5 if scale is None else float(scale)
    return ChunkKDAFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
