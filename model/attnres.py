"""Block Attention Residuals (AttnRes paper, arXiv 2603.15031; K3 Eq. 8-10).

Instead of adding every sub-layer output to one residual stream, each sub-layer (attention, MoE)
and the final output read a softmax mixture of a few sources: the token embedding, each completed
block's summed output, and the running sum of the current block:

    h = sum_i softmax_i(w^T RMSNorm(v_i)) v_i

with a learned pseudo-query w per sub-layer, zero-initialised (uniform mixing at step 0), no
temperature, keys RMS-normalised, values not. Wiring follows NeMo's ``_forward_attn_residual`` /
FLA's ``KDABlock.forward`` (see model/modeling.py).

Memory: autograd on the mix keeps the stacked sources, their fp32 RMS-normalised copy and the
normed output, about three [S, B, T, D] fp32 tensors per mix (33 mixes in gpu_1b). With
``model.fast`` op "attn_res" = ``recompute`` only the sources are kept (they are the block sums the
model holds anyway) and the mix is recomputed in backward: the same ops, bit-exact; ``fused`` (the
default; on CUDA ``triton``, the same node on two Triton kernels) runs the mix and the sub-layer's RMSNorm
after it as one autograd node (``attn_res_mix_norm`` forward, ``attn_res_mix_norm_grads`` backward: the
closed-form gradient, the forward recomputed inside it),
which also keeps only the sources: one compiled call each way, where a checkpoint made three (forward,
recomputation, backward) and its own bookkeeping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model import fast
from model.layers import RMSNorm, f32, recompute_in_backward, rms_norm


def attn_res_mix(
    query: torch.Tensor, norm_weight: torch.Tensor, eps: float, *sources: torch.Tensor
) -> torch.Tensor:
    """The mix of two or more sources as a function of the weights: one compiled graph per (number of
    sources, dtype, rank) serves every mix of the model (``model.compile``). The keys are normalised
    from the one fp32 copy of the stacked sources (in fp32 the reference's ops; in bf16 the normed keys
    are no longer rounded to bf16 before the dot product with the query)."""
    return attn_res_mix_stacked(query, norm_weight, eps, torch.stack(sources))


def attn_res_mix_stacked(
    query: torch.Tensor, norm_weight: torch.Tensor, eps: float, v_SBTD: torch.Tensor
) -> torch.Tensor:
    """``attn_res_mix`` of sources stacked by the caller [S, ...]: compiled, one graph serves every number of
    sources (S is a dynamic dim), where ``attn_res_mix`` compiles once per number. The engine's mixes take
    it (``model.serving.prepare_for_serving``): four compiles of 1.3-1.8 s each in an engine's start on the
    H200 become one. Not the learner's: a stacked copy made outside the graph is one more tensor that
    autograd would keep per mix."""
    v32_SBTD = f32(v_SBTD)
    keys_SBTD = F.rms_norm(v32_SBTD, v32_SBTD.shape[-1:], norm_weight.to(v32_SBTD.dtype), eps)
    a_SBT = (keys_SBTD * f32(query)).sum(-1).softmax(dim=0)
    return (a_SBT[..., None] * v32_SBTD).sum(0).to(v_SBTD.dtype)


def attn_res_mix_norm(
    query: torch.Tensor, norm_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    *sources: torch.Tensor,
) -> torch.Tensor:
    """``rms_norm(attn_res_mix(...), out_weight, out_eps)``: a sub-layer's input (the mix, then the sub-layer's
    own RMSNorm) as one function, so the learner runs it as one region where the mix and the norm were two
    (``AttnResMix.normed``; 384 -> 288 compiled calls a gpu_1b learner step, H200 2026-12-04, while it was
    checkpointed; now the forward of a node whose backward is ``attn_res_mix_norm_grads``). Eager it is the same
    ops as the two calls, bit for bit; compiled, the bf16 rounding of the mix before the norm may be elided
    (inductor keeps fused intermediates in fp32)."""
    return rms_norm(attn_res_mix(query, norm_weight, eps, *sources), out_weight, out_eps)


def attn_res_mix_norm_grads(
    query: torch.Tensor, norm_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    dh: torch.Tensor, *sources: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """(d query, d norm_weight, d out_weight, *d sources) of ``attn_res_mix_norm`` for the output gradient dh,
    in closed form, the forward recomputed from the sources (fp32 math; each gradient in its input's dtype):
    the backward of the learner's mix-and-norm node, one compiled region per number of sources.

    With keys n_i = r_i g_k v_i (r_i = rsqrt(mean v_i^2 + eps)), scores s_i = <n_i, w> = r_i <v_i, u> for
    u = g_k w, a = softmax(s), m = sum_i a_i v_i and h = rho g_o m (rho = rsqrt(mean m^2 + out_eps)):
    dm = rho (y - rho^2 m mean(m y)) for y = g_o dh, ds_i = a_i (<dm, v_i> - sum_j a_j <dm, v_j>),
    dv_i = a_i dm + ds_i (r_i u - r_i^3 <v_i, u> v_i / D), du = sum ds_i r_i v_i (dw = g_k du, dg_k = w du)
    and dg_o = sum dh rho m, the sums over tokens where a weight's gradient needs them. The forward rounds m
    to the sources' dtype before its norm; this takes the fp32 m (as inductor's fused forward does)."""
    v = f32(torch.stack(sources))  # [S, ..., D]
    D = v.shape[-1]
    w, gk, go = f32(query), f32(norm_weight), f32(out_weight)
    u = gk * w
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    vu = (v * u).sum(-1, keepdim=True)
    a = (r * vu).softmax(dim=0)
    m = (a * v).sum(0)
    rho = torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + out_eps)
    dh32 = f32(dh)
    y = dh32 * go
    dm = rho * (y - m * rho.pow(2) * (m * y).mean(-1, keepdim=True))
    da = (dm * v).sum(-1, keepdim=True)
    ds = a * (da - (a * da).sum(0, keepdim=True))
    dv = a * dm + ds * (r * u - r.pow(3) * vu * v / D)
    du = (ds * r * v).reshape(-1, D).sum(0)
    dgo = (dh32 * m * rho).reshape(-1, D).sum(0)
    return ((du * gk).to(query.dtype), (du * w).to(norm_weight.dtype), dgo.to(out_weight.dtype),
            *(dv[i].to(src.dtype) for i, src in enumerate(sources)))  # fmt: skip


TRITON_BACKWARDS = {"triton": "tile", "triton_passes": "passes", "triton_rows": "rows"}
"""``model.fast`` op "attn_res" choices that run the node on ``kernels.attnres.triton``, and the backward kernel each
takes (``BACKWARD_KERNELS``)."""


class _MixNormNode(torch.autograd.Function):
    """``fns[0](query, norm_weight, eps, out_weight, out_eps, *sources)`` (``attn_res_mix_norm``) keeping only the
    sources and weights; backward ``fns[1]`` (``attn_res_mix_norm_grads``)."""

    @staticmethod
    def forward(ctx, fns, query, norm_weight, eps, out_weight, out_eps, *sources):
        ctx.grads_fn, ctx.eps = fns[1], (eps, out_eps)
        ctx.save_for_backward(query, norm_weight, out_weight, *sources)
        return fns[0](query, norm_weight, eps, out_weight, out_eps, *sources)

    @staticmethod
    def backward(ctx, dh):
        query, norm_weight, out_weight, *sources = ctx.saved_tensors
        (eps, out_eps), args = ctx.eps, (query, norm_weight)
        dq, dnw, dow, *dsources = ctx.grads_fn(*args, eps, out_weight, out_eps, dh.contiguous(), *sources)
        return None, dq, dnw, None, dow, None, *dsources


class AttnResMix(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.norm = RMSNorm(hidden_size, eps=eps)  # its weight and eps; the mix normalises itself
        self.mix_fn: Callable = attn_res_mix  # ``model.compile.compile_regions`` swaps in the compiled one
        # inference: ``attn_res_mix_stacked`` over the sources stacked first (``model.serving.prepare_for_serving``
        # sets it; compiled likewise), None: ``mix_fn``
        self.stacked_mix_fn: Callable | None = None
        # inference on CUDA: the mix and the sub-layer's norm as one kernel over the stacked sources
        # (``kernels.attnres.attn_res_mix_norm_triton``, same arguments as ``attn_res_mix_norm`` but the sources
        # stacked; set by ``prepare_for_serving``), None: the mix, then the norm
        self.stacked_mix_norm_fn: Callable | None = None
        self.mix_norm_fn: Callable = attn_res_mix_norm  # compiled likewise
        self.mix_norm_grads_fn: Callable = attn_res_mix_norm_grads  # compiled likewise

    def forward(self, sources: list[torch.Tensor], norm: RMSNorm | None = None) -> torch.Tensor:
        """The mix of ``sources``; with ``norm``, ``norm`` of the mix as one region (``attn_res_mix_norm``;
        ``normed`` says when). Through the module call either way, so hooks on this module run (FSDP gathers
        the query and key-norm weight in them: ``rl.parallel`` shards each mix as a unit of its own)."""
        if len(sources) == 1:
            return sources[0] if norm is None else norm(sources[0])
        if norm is not None:
            fns = self._mix_norm_fns(sources)
            if torch.is_grad_enabled() and any(t.requires_grad for t in (*sources, *self.parameters(), norm.weight)):
                return _MixNormNode.apply(fns, self.query, self.norm.weight, self.norm.eps, norm.weight, norm.eps,
                                          *sources)  # fmt: skip
            # with gradient a node of its own (``_MixNormNode``), not a compiled region's autograd: a compiled mix's
            # own backward graph keeps a stacked copy of the sources (inductor's partitioner), about S x [T, D] more
            # a mix than the sources
            return fns[0](self.query, self.norm.weight, self.norm.eps, norm.weight, norm.eps, *sources)
        if fast.pick("attn_res", sources[0].device) in ("recompute", "fused", *TRITON_BACKWARDS):
            return recompute_in_backward(self.mix, *sources)
        return self.mix(*sources)

    def _mix_norm_fns(self, sources: list[torch.Tensor]) -> tuple[Callable, Callable]:
        """(forward, gradient) of the mix-and-norm node: ``model.fast`` op "attn_res" = triton on CUDA with at most
        ``MAX_SOURCES`` sources, the Triton kernels (``kernels.attnres.triton``); else the (compiled) functions."""
        op = fast.pick("attn_res", sources[0].device)
        if sources[0].is_cuda and op in TRITON_BACKWARDS:
            from kernels.attnres.triton import MAX_SOURCES, mix_norm_forward, mix_norm_grads

            if len(sources) <= MAX_SOURCES:
                return mix_norm_forward, functools.partial(mix_norm_grads, kernel=TRITON_BACKWARDS[op])
        return self.mix_norm_fn, self.mix_norm_grads_fn

    def normed(self, sources: list[torch.Tensor], norm: RMSNorm) -> torch.Tensor:
        """``norm(self(sources))``: the input of the sub-layer that ``norm`` belongs to. With ``model.fast`` op
        "attn_res" = fused (the default) and the sources unstacked (the learner), one node (``attn_res_mix_norm``
        forward, its closed-form gradient backward; the norm goes with the mix whatever op "norm" says); an
        engine's (``stacked_mix_norm_fn``) as one kernel over the stacked sources unless op "attn_res"
        names the reference; else the two modules one after the other."""
        op = fast.pick("attn_res", sources[0].device)
        if self.stacked_mix_norm_fn is not None and len(sources) > 1 and op != "torch":
            return self.stacked_mix_norm_fn(
                self.query, self.norm.weight, self.norm.eps, norm.weight, norm.eps, torch.stack(sources)
            )
        if op in ("fused", *TRITON_BACKWARDS) and self.stacked_mix_fn is None:
            return self(sources, norm)  # one source: ``forward`` norms it
        return norm(self(sources))

    def mix(self, *sources: torch.Tensor) -> torch.Tensor:
        """The mix of two or more sources (autograd keeps its intermediates unless recomputed)."""
        if self.stacked_mix_fn is not None:
            return self.stacked_mix_fn(self.query, self.norm.weight, self.norm.eps, torch.stack(sources))
        return self.mix_fn(self.query, self.norm.weight, self.norm.eps, *sources)
