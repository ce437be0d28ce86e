"""`chunk_kda_triton`: the autograd Function over the Triton forward (fwd.py) and backward (bwd.py).

Same signature and conventions as `kernels.kda.naive_recurrent_kda` (flash-linear-attention's layout):
q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], state [N, H, K, V] in fp32, B = 1 with
cu_seqlens. Contract: g >= G_MIN = -5 (the bounded gate); with LONGHORIZON_KDA_DEBUG=1 or
LONGHORIZON_KDA_CHECK=1 (the CPU path's switch) it is checked (a device sync).
Differences from the peer: no GQA/GVA head ratios (the model uses equal head counts), no gate or L2 norm
fused in; the per-chunk states and Vn of the forward are kept for the backward instead of recomputed.

``chunk_kda_planned``: the training case (no state in or out) given the chunk plan's tensors, as two custom
ops (``kda_chunk_fwd``, ``kda_chunk_bwd``) under an autograd node with nothing else inside, so that dynamo
traces it into a compiled graph (the learner's KDA layer, ``model.kda.kda_planned_forward``): the plan's
host numbers come from its tensors' shapes (chunks = rows of ``chunk_indices``), nothing is read back.
"""

from __future__ import annotations

import torch

from kernels.kda.naive import _check_inputs, check_gate
from kernels.kda.triton.bwd import kda_bwd
from kernels.kda.triton.common import BT, G_MIN, ChunkPlan, debug_enabled, plan_chunks
from kernels.kda.triton.fwd import kda_fwd
from kernels.op_names import op_name

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


# ------------------------------------------------------------------ the training case as traceable custom ops
def _plan_of(cu_N1: torch.Tensor, ci_C2: torch.Tensor, co_N1: torch.Tensor) -> ChunkPlan:
    return ChunkPlan(cu_N1, ci_C2, co_N1, cu_N1.shape[0] - 1, ci_C2.shape[0])


_Saved9 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                torch.Tensor, torch.Tensor]  # fmt: skip


@torch.library.custom_op(op_name("kda_chunk_fwd"), mutates_args=())
def kda_chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_N1: torch.Tensor,
    ci_C2: torch.Tensor, co_N1: torch.Tensor, scale: float,
) -> _Saved9:  # fmt: skip
    """(o, then what the backward reads: ``_SAVED``) for tokens flattened to [T, H, *], no state in or out."""
    out = kda_fwd(q, k, v, g, beta, scale, None, _plan_of(cu_N1, ci_C2, co_N1), store_ht=False)
    return out["o"], *(out[name] for name in _SAVED)


@kda_chunk_fwd.register_fake
def _(q, k, v, g, beta, cu_N1, ci_C2, co_N1, scale):
    (T, H, K), V, NC = q.shape, v.shape[-1], ci_C2.shape[0]
    e = lambda *shape, dtype=q.dtype: q.new_empty(shape, dtype=dtype)
    f32 = torch.float32
    # o, G, Aqk, Ainv, W, Hc, Vn, Qg, Kd as kda_fwd allocates them
    return (e(T, H, V), e(T, H, K, dtype=f32), e(T, H, BT), e(T, H, BT, dtype=f32), e(T, H, K), e(NC, H, K, V),
            e(T, H, V), e(T, H, K), e(T, H, K))  # fmt: skip


@torch.library.custom_op(op_name("kda_chunk_bwd"), mutates_args=())
def kda_chunk_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_N1: torch.Tensor,
    ci_C2: torch.Tensor, co_N1: torch.Tensor, G: torch.Tensor, Aqk: torch.Tensor, Ainv: torch.Tensor,
    W: torch.Tensor, Hc: torch.Tensor, Vn: torch.Tensor, Qg: torch.Tensor, Kd: torch.Tensor, do: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) of ``kda_chunk_fwd`` for the output gradient do."""
    saved = dict(zip(_SAVED, (G, Aqk, Ainv, W, Hc, Vn, Qg, Kd), strict=True))
    plan = _plan_of(cu_N1, ci_C2, co_N1)
    return kda_bwd(q, k, v, g, beta, scale, None, plan, saved, do.contiguous(), None)[:5]


@kda_chunk_bwd.register_fake
def _(q, k, v, g, beta, cu_N1, ci_C2, co_N1, G, Aqk, Ainv, W, Hc, Vn, Qg, Kd, do, scale):
    return tuple(torch.empty_like(x) for x in (q, k, v, g, beta))


class _ChunkKDAPlanned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_N1, ci_C2, co_N1, scale: float):
        B, T, H = q.shape[:3]
        flat = [_flat(x) for x in (q, k, v, g, beta)]
        o, *saved = kda_chunk_fwd(*flat, cu_N1, ci_C2, co_N1, scale)
        ctx.save_for_backward(*flat, cu_N1, ci_C2, co_N1, *saved)
        ctx.scale = scale
        return o.view(B, T, H, v.shape[-1])

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, cu_N1, ci_C2, co_N1, *saved = ctx.saved_tensors
        B, T = do.shape[:2]
        grads = kda_chunk_bwd(q, k, v, g, beta, cu_N1, ci_C2, co_N1, *saved, _flat(do), ctx.scale)
        return (*(x.view(B, T, *x.shape[1:]) for x in grads), None, None, None, None)


def chunk_kda_planned(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_N1: torch.Tensor,
    ci_C2: torch.Tensor, co_N1: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """o [B, T, H, V] of ``chunk_kda_triton`` without state in or out, given the tensors of its cu_seqlens'
    chunk plan (``plan_chunks``: ``cu_seqlens_N1``, ``chunk_indices_C2``, ``chunk_offsets_N1``); the same
    kernels, so the same values, and differentiable in q, k, v, g and beta."""
    return _ChunkKDAPlanned.apply(q, k, v, g, beta, cu_N1, ci_C2, co_N1, float(scale))
