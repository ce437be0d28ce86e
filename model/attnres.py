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
from typing import NamedTuple

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


class MixNormFns(NamedTuple):
    """The mix-and-norm node's functions: ``forward`` (``attn_res_mix_norm``'s arguments) and ``grads``
    (``attn_res_mix_norm_grads``'); ``adds_into``: ``grads`` takes ``into=`` (per source a buffer to add that
    source's gradient to in place, or None), as ``kernels.attnres.triton.mix_norm_grads`` does."""

    forward: Callable
    grads: Callable
    adds_into: bool = False


class _Slot:
    """One shared source's gradient so far (``SharedSourceGrads``): None until a mix's backward adds to it."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class SharedSourceGrads:
    """Gradient accumulators of the sources the mixes of one forward share. A completed block is a source of
    every later mix (up to 30 in gpu_1b): autograd gives each mix's backward a fresh gradient per source and sums
    them with one more pass each (113 in-place adds, 5.6 ms of a 16K gpu_1b step on an H100). Here a shared
    source's later mixes add their gradients into one buffer (in the Triton kernel itself where the node runs on
    it) and hand autograd nothing for it; its earliest mix adds its own and returns the sum.

    Sound because the mixes' backwards run in the reverse of their forward order: each mix's newest source is the
    running block sum after the sub-layer the previous mix feeds, so a mix's backward waits for the next one's
    (the earliest mix of a source runs last of its mixes). A source's buffer is cleared once returned, so a
    second backward of the same graph (``retain_graph``) starts afresh. One registry per forward: sources are told
    apart by ``id``, which stays unique while the forward holds them."""

    def __init__(self) -> None:
        self._slots: dict[int, _Slot] = {}

    def register(self, sources: tuple[torch.Tensor, ...]) -> tuple[tuple[_Slot, bool] | None, ...]:
        """Per source of a mix (called in forward order): (its slot, whether this mix is its earliest), or None for
        a source without gradient or one the mix reads twice (those go to autograd, which sums them with the
        rest: whichever mix registers a source first returns its slot)."""
        repeated = {id(t) for t in sources if sum(u is t for u in sources) > 1}
        roles = []
        for t in sources:
            if not t.requires_grad or id(t) in repeated:
                roles.append(None)
                continue
            slot = self._slots.get(id(t))
            earliest = slot is None
            if earliest:
                slot = self._slots[id(t)] = _Slot()
            roles.append((slot, earliest))
        return tuple(roles)


class _MixNormNode(torch.autograd.Function):
    """``fns.forward(query, norm_weight, eps, out_weight, out_eps, *sources)`` (``attn_res_mix_norm``) keeping only
    the sources and weights; backward ``fns.grads`` (``attn_res_mix_norm_grads``), its sources' gradients gathered
    through ``shared`` (a ``SharedSourceGrads``; None: every gradient handed to autograd)."""

    @staticmethod
    def forward(ctx, fns: MixNormFns, shared, query, norm_weight, eps, out_weight, out_eps, *sources):
        ctx.fns, ctx.eps = fns, (eps, out_eps)
        ctx.roles = shared.register(sources) if shared is not None else (None,) * len(sources)
        ctx.save_for_backward(query, norm_weight, out_weight, *sources)
        return fns.forward(query, norm_weight, eps, out_weight, out_eps, *sources)

    @staticmethod
    def backward(ctx, dh):
        query, norm_weight, out_weight, *sources = ctx.saved_tensors
        (eps, out_eps), fns, roles = ctx.eps, ctx.fns, ctx.roles
        into = [role[0].grad if role is not None else None for role in roles]
        args = (query, norm_weight, eps, out_weight, out_eps, dh.contiguous(), *sources)
        if fns.adds_into:
            dq, dnw, dow, *dsources = fns.grads(*args, into=into)
        else:
            dq, dnw, dow, *fresh = fns.grads(*args)
            dsources = [g if acc is None else acc.add_(g) for acc, g in zip(into, fresh, strict=True)]
        return None, None, dq, dnw, None, dow, None, *(_handed(role, g) for role, g in zip(roles, dsources))


def _handed(role: tuple[_Slot, bool] | None, grad: torch.Tensor) -> torch.Tensor | None:
    """What a mix's backward hands autograd for one source: the gradient summed so far at the source's earliest mix
    (its slot cleared), nothing at a later one (the sum kept in the slot), the gradient where nothing is shared."""
    if role is None:
        return grad
    slot, earliest = role
    slot.grad = None if earliest else grad
    return grad if earliest else None


class AttnResMix(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.norm = RMSNorm(hidden_size, eps=eps)  # its weight and eps; the mix normalises itself
        self.mix_fn: Callable = attn_res_mix  # ``model.compile.compile_regions`` swaps in the compiled one
        # inference: ``attn_res_mix_stacked`` over the sources stacked first (``model.serving.prepare_for_serving``
        # sets it; compiled likewise), None: ``mix_fn``
        self.stacked_mix_fn: Callable | None = None
        # inference on CUDA: the mix and the sub-layer's norm as one kernel over the sources where they are
        # (``kernels.attnres.attn_res_mix_norm_sources_triton``, the arguments of ``attn_res_mix_norm``; set by
        # ``prepare_for_serving``), None: the mix, then the norm
        self.sources_mix_norm_fn: Callable | None = None
        self.mix_norm_fn: Callable = attn_res_mix_norm  # compiled likewise
        self.mix_norm_grads_fn: Callable = attn_res_mix_norm_grads  # compiled likewise

    def forward(
        self, sources: list[torch.Tensor], norm: RMSNorm | None = None, shared: SharedSourceGrads | None = None
    ) -> torch.Tensor:
        """The mix of ``sources``; with ``norm``, ``norm`` of the mix as one region (``attn_res_mix_norm``;
        ``normed`` says when), its sources' gradients gathered through ``shared`` (``SharedSourceGrads``). Through
        the module call either way, so hooks on this module run (FSDP gathers the query and key-norm weight in
        them: ``rl.parallel`` shards each mix as a unit of its own)."""
        if len(sources) == 1:
            return sources[0] if norm is None else norm(sources[0])
        if norm is not None:
            fns = self._mix_norm_fns(sources)
            if torch.is_grad_enabled() and any(t.requires_grad for t in (*sources, *self.parameters(), norm.weight)):
                return _MixNormNode.apply(fns, shared, self.query, self.norm.weight, self.norm.eps, norm.weight,
                                          norm.eps, *sources)  # fmt: skip
            # with gradient a node of its own (``_MixNormNode``), not a compiled region's autograd: a compiled mix's
            # own backward graph keeps a stacked copy of the sources (inductor's partitioner), about S x [T, D] more
            # a mix than the sources
            return fns.forward(self.query, self.norm.weight, self.norm.eps, norm.weight, norm.eps, *sources)
        if fast.pick("attn_res", sources[0].device) in ("recompute", "fused", *TRITON_BACKWARDS):
            return recompute_in_backward(self.mix, *sources)
        return self.mix(*sources)

    def _mix_norm_fns(self, sources: list[torch.Tensor]) -> MixNormFns:
        """The mix-and-norm node's functions: ``model.fast`` op "attn_res" = triton on CUDA with at most
        ``MAX_SOURCES`` sources, the Triton kernels (``kernels.attnres.triton``); else the (compiled) functions."""
        op = fast.pick("attn_res", sources[0].device)
        if sources[0].is_cuda and op in TRITON_BACKWARDS:
            from kernels.attnres.triton import MAX_SOURCES, mix_norm_forward, mix_norm_grads

            if len(sources) <= MAX_SOURCES:
                grads = functools.partial(mix_norm_grads, kernel=TRITON_BACKWARDS[op])
                return MixNormFns(mix_norm_forward, grads, adds_into=True)
        return MixNormFns(self.mix_norm_fn, self.mix_norm_grads_fn)

    def normed(
        self, sources: list[torch.Tensor], norm: RMSNorm, shared: SharedSourceGrads | None = None
    ) -> torch.Tensor:
        """``norm(self(sources))``: the input of the sub-layer that ``norm`` belongs to. With ``model.fast`` op
        "attn_res" = fused (the default) and the sources unstacked (the learner), one node (``attn_res_mix_norm``
        forward, its closed-form gradient backward; the norm goes with the mix whatever op "norm" says); an
        engine's (``sources_mix_norm_fn``) as one kernel unless op "attn_res" names the reference; else the two
        modules one after the other."""
        op = fast.pick("attn_res", sources[0].device)
        if self.sources_mix_norm_fn is not None and len(sources) > 1 and op != "torch":
            weights = (self.query, self.norm.weight, self.norm.eps, norm.weight, norm.eps)
            return self.sources_mix_norm_fn(*weights, *sources)
        if op in ("fused", *TRITON_BACKWARDS) and self.stacked_mix_fn is None:
            return self(sources, norm, shared)  # one source: ``forward`` norms it
        return norm(self(sources))

    def mix(self, *sources: torch.Tensor) -> torch.Tensor:
        """The mix of two or more sources (autograd keeps its intermediates unless recomputed)."""
        if self.stacked_mix_fn is not None:
            return self.stacked_mix_fn(self.query, self.norm.weight, self.norm.eps, torch.stack(sources))
        return self.mix_fn(self.query, self.norm.weight, self.norm.eps, *sources)
