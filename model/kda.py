"""Kimi Delta Attention layer (K3 Eq. 1-6) around ``kernels.kda``.

q, k = L2Norm(SiLU(ShortConv4(W x))), v = SiLU(ShortConv4(W_v x)), beta = sigmoid(W_b x),
decay logits z = f_b(f_a(x)) + dt_bias (low rank = head_dim), and per channel:

    bounded (K3, default):  g = g_min * sigmoid(exp(A_log) * z)    in (g_min, 0), A_log init 0
    unbounded (Kimi Linear): g = -exp(A_log) * softplus(z)          in (-inf, 0), A_log = log U(1, 16)

Gate math runs in fp32 and the kernel gets g already mapped (FLA's ``use_gate_in_kernel=False``
with a caller-guaranteed bound, as NeMo's K3 port does). Output: o_proj(sigmoid(g_proj x) *
RMSNorm_head(o)) with a full-rank gate (K3), or with ``linear_attn_config["use_full_rank_gate"]``
false Kimi Linear's low-rank one, sigmoid(g_b_proj(g_a_proj x)) of rank head_dim.
Parameter names follow FLA/NeMo so checkpoints map onto vLLM's KimiDeltaAttention.

The element-wise work around the kernels is three functions of tensors and constants, each one compiled
region under ``model.compile`` (shared by every KDA layer, and by the vLLM decode step): ``kda_gates``
(decay and beta from their projections), ``l2_normalize_qk`` and ``kda_output_gate`` (the head RMSNorm
times the output gate). Eager, they are the same ops as before, recomputed in backward where
``model.fast`` op "norm" says so.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from model import fast
from model.cache import KDAState
from model.config import HybridConfig
from model.layers import (
    CONV_BACKWARDS,
    RMSNorm,
    SeqLayout,
    ShortConvolution,
    f32,
    l2_normalize_qk,
    recompute_region,
    rms_norm,
)


def kda_gate(z: torch.Tensor, A_log_H: torch.Tensor, kind: str, lower_bound: float) -> torch.Tensor:
    """Per-channel log-decay from decay logits z [..., H, D] in fp32."""
    z32 = f32(z)
    A_H1 = f32(A_log_H).exp()[:, None]
    if kind == "bounded":
        return lower_bound * torch.sigmoid(A_H1 * z32)
    if kind == "unbounded":
        return -A_H1 * F.softplus(z32)
    raise ValueError(f"kda gate must be 'bounded' or 'unbounded', got {kind!r}")


def kda_gates(
    zf_BTX: torch.Tensor,
    b_BTH: torch.Tensor,
    dt_bias_X: torch.Tensor,
    A_log_H: torch.Tensor,
    kind: str,
    lower_bound: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [..., H, D], beta [..., H]) in fp32 from the decay projection f_b(f_a(x)) [..., H*D] and the beta
    logits b_proj(x) [..., H]: one compiled region per dtype (``model.compile``)."""
    z = f32(zf_BTX) + f32(dt_bias_X)
    g = kda_gate(z.view(*z.shape[:-1], A_log_H.shape[0], -1), A_log_H, kind, lower_bound)
    return g, torch.sigmoid(f32(b_BTH))


def kda_output_gate(
    o_BTHV: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_BTX: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """RMSNorm_head(o) * sigmoid(output gate logits), o cast to ``dtype`` (the residual stream's) first."""
    o = rms_norm(o_BTHV.to(dtype), norm_weight, eps)
    return o * torch.sigmoid(gate_BTX).view(o.shape)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = int(lac["num_heads"]), int(lac["head_dim"])
        self.lower_bound = float(lac["gate_lower_bound"])
        self.gate_kind = config.kda_gate
        d, HD, K = config.hidden_size, self.num_heads * self.head_dim, int(lac["short_conv_kernel_size"])
        self.q_proj = nn.Linear(d, HD, bias=False)
        self.k_proj = nn.Linear(d, HD, bias=False)
        self.v_proj = nn.Linear(d, HD, bias=False)
        self.q_conv1d = ShortConvolution(HD, K)
        self.k_conv1d = ShortConvolution(HD, K)
        self.v_conv1d = ShortConvolution(HD, K)
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, HD, bias=False)
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(HD))
        self.full_rank_gate = bool(lac.get("use_full_rank_gate", True))
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, HD, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, HD, bias=False)
        self.o_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(HD, d, bias=False)
        # ``model.compile.compile_regions`` swaps in the compiled ones
        self.gates_fn, self.qk_norm_fn, self.out_gate_fn = kda_gates, l2_normalize_qk, kda_output_gate
        self.forward_fn = kda_forward  # scope "blocks" of ``model.compile``: the whole layer compiled
        self.planned_fn = kda_planned_forward  # the same, for the planned path (no state in or out)
        self.reset_gate_parameters()

    def initial_gate_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K3 init: A = 0 for the bounded gate (Kimi Linear's log U(1, 16) for the unbounded one);
        dt_bias = softplus^-1(dt) with dt ~ logU(1e-3, 1e-1), clamped at >= 1e-4."""
        like_A, like_dt = self.A_log.detach(), self.dt_bias.detach()
        if self.gate_kind == "bounded":
            A_log = torch.zeros_like(like_A)
        else:
            A_log = torch.empty_like(like_A).uniform_(1, 16).log()
        u = torch.rand_like(like_dt)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        return A_log, dt + torch.log(-torch.expm1(-dt))

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        A_log, dt_bias = self.initial_gate_values()
        self.A_log.copy_(A_log)
        self.dt_bias.copy_(dt_bias)

    def output_gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid output gate [..., H*D]: full rank (K3) or low rank (Kimi Linear)."""
        return self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def gates(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [..., H, D], beta [..., H]) in fp32 for x [..., d]."""
        zf, b = self.f_b_proj(self.f_a_proj(x_BTD)), self.b_proj(x_BTD)
        return self.gates_fn(zf, b, self.dt_bias, self.A_log, self.gate_kind, self.lower_bound)

    def normalize_qk(self, q_BTHK: torch.Tensor, k_BTHK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """L2-normalised q and k (fp32 math, their dtype); only q and k are kept for backward when
        ``model.fast`` op "norm" recomputes."""
        if fast.pick("norm", q_BTHK.device) == "recompute":
            return recompute_region(self.qk_norm_fn, q_BTHK, k_BTHK)
        return self.qk_norm_fn(q_BTHK, k_BTHK)

    def gated_output(self, o_BTHV: torch.Tensor, x_BTD: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj(RMSNorm_head(o) * sigmoid(gate(x))) [..., d]; ``gate``: the gate logits when the caller has
        them already (the vLLM decode step's fused projection)."""
        if gate is None:
            gate = self.output_gate_logits(x_BTD)
        args = (o_BTHV, self.o_norm.weight, self.o_norm.eps, gate, x_BTD.dtype)
        if fast.pick("norm", o_BTHV.device) == "recompute":
            o_BTHV = recompute_region(self.out_gate_fn, *args)
        else:
            o_BTHV = self.out_gate_fn(*args)
        return self.o_proj(o_BTHV.flatten(-2))

    def forward(
        self,
        x_BTD: torch.Tensor,
        layout: SeqLayout,
        cu_seqlens: torch.Tensor | None = None,
        state: KDAState | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, KDAState | None]:
        """(y [B, T, d], the new state if ``return_state``). Without a state in or out on the Triton conv and
        KDA kernels (training, no-grad logprob passes) the planned path ``kda_planned_forward``: the layout's
        positions and chunk plan built here, once per layout, and handed over as tensors."""
        if state is None and not return_state and self._planned_path(x_BTD):
            B, T, _ = x_BTD.shape
            plan = _layout_plan(layout, B, T, cu_seqlens, x_BTD.device)
            args = (layout.positions_i32(), plan.cu_seqlens_N1, plan.chunk_indices_C2, plan.chunk_offsets_N1)
            return self.planned_fn(self, x_BTD, *args), None
        return self.forward_fn(self, x_BTD, layout, cu_seqlens, state, return_state)

    def _planned_path(self, x_BTD: torch.Tensor) -> bool:
        """The bounded gate's chunked kernel and the Triton conv (``model.fast`` op "conv"), on CUDA or under
        the Triton interpreter, and no debug check of the gate (a host sync)."""
        if self.gate_kind != "bounded" or fast.pick("conv", x_BTD.device) not in CONV_BACKWARDS:
            return False
        if not (x_BTD.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            return False
        from kernels.kda.triton.common import debug_enabled

        return not debug_enabled()

    def _kernel(self, T: int, state: KDAState | None):
        """Chunked kernel for prefill/training; the step recurrence for decode and for the
        unbounded gate (the chunked path's dense 16-token tiles are only safe for g >= g_min)."""
        from kernels.kda import chunk_kda, fused_recurrent_kda

        if (state is not None and T == 1) or self.gate_kind == "unbounded":
            return fused_recurrent_kda
        return functools.partial(chunk_kda, lower_bound=self.lower_bound)


def kda_forward(
    attn: KimiDeltaAttention,
    x_BTD: torch.Tensor,
    layout: SeqLayout,
    cu_seqlens: torch.Tensor | None,
    state: KDAState | None,
    return_state: bool,
) -> tuple[torch.Tensor, KDAState | None]:
    """``KimiDeltaAttention.forward``, a function of the module: ``model.compile`` scope "blocks" compiles it
    once for every KDA layer (projections, q/k norms, gates and gated output in one graph each side of the
    kernel), while the short convolutions and the kernel, which read the layout's host bounds, run outside
    any graph (``_short_convs``, ``_kda_kernel``), so the layout never becomes a guard."""
    B, T, _ = x_BTD.shape
    H, Dh = attn.num_heads, attn.head_dim
    x_qkv = (attn.q_proj(x_BTD), attn.k_proj(x_BTD), attn.v_proj(x_BTD))
    (q, conv_q), (k, conv_k), (v, conv_v) = _short_convs(attn, x_qkv, layout, state, return_state)
    q_BTHK, k_BTHK = attn.normalize_qk(q.view(B, T, H, Dh), k.view(B, T, H, Dh))
    g_BTHK, beta_BTH = attn.gates(x_BTD)
    o_BTHV, final_NHKV = _kda_kernel(
        attn, q_BTHK, k_BTHK, v.view(B, T, H, Dh), g_BTHK, beta_BTH, layout, cu_seqlens, state, return_state
    )
    y_BTD = attn.gated_output(o_BTHV, x_BTD)
    new_state = KDAState(final_NHKV, conv_q, conv_k, conv_v) if return_state else None
    return y_BTD, new_state


@torch.compiler.disable
def _short_convs(attn: KimiDeltaAttention, x_qkv, layout: SeqLayout, state: KDAState | None, need_state: bool):
    """[(y, conv state)] of the q, k and v short convolutions (outside compiled graphs: see ``kda_forward``)."""
    convs = (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
    states = (state.conv_q_NCW, state.conv_k_NCW, state.conv_v_NCW) if state else (None, None, None)
    return [conv(x, layout, s, need_state=need_state) for conv, x, s in zip(convs, x_qkv, states)]


@torch.compiler.disable
def _kda_kernel(attn: KimiDeltaAttention, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, layout: SeqLayout,
                cu_seqlens, state: KDAState | None, return_state: bool):  # fmt: skip
    """(o [B, T, H, V], final state or None): the kernel ``attn._kernel`` picks, its chunk plan built once per
    layout from the host bounds (outside compiled graphs: see ``kda_forward``), which the kernel's own plan
    lookups take too (``host_bounds``: no device read of a rollout engine's inference-mode offsets)."""
    B, T = q_BTHK.shape[:2]
    scope = contextlib.nullcontext()
    if cu_seqlens is not None and q_BTHK.is_cuda:
        from kernels.kda.triton.common import host_bounds

        _layout_plan(layout, B, T, cu_seqlens, q_BTHK.device)
        scope = host_bounds(cu_seqlens, _host_offsets(layout))
    with scope:
        return attn._kernel(T, state)(
            q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH,
            scale=attn.head_dim**-0.5,
            initial_state=state.recurrent_NHKV if state else None,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip


def kda_planned_forward(
    attn: KimiDeltaAttention,
    x_BTD: torch.Tensor,
    pos_BT: torch.Tensor,
    cu_N1: torch.Tensor,
    ci_C2: torch.Tensor,
    co_N1: torch.Tensor,
) -> torch.Tensor:
    """``kda_forward`` without a state in or out, given the layout's int32 positions [B, T] and the tensors of
    its KDA chunk plan (``kernels.kda.triton.chunk.chunk_kda_planned``): the convolutions and the kernel are
    custom ops under autograd nodes with nothing else inside, and nothing reads the host, so ``model.compile``
    scope "blocks" compiles the whole layer as one graph each way (projections, convolutions, norms, gates,
    kernel, gated output). The same kernels as ``kda_forward``'s Triton path, so the same values."""
    from kernels.kda.triton.chunk import chunk_kda_planned

    B, T, _ = x_BTD.shape
    H, Dh = attn.num_heads, attn.head_dim
    projections = ((attn.q_proj, attn.q_conv1d), (attn.k_proj, attn.k_conv1d), (attn.v_proj, attn.v_conv1d))
    q, k, v = (conv.conv_positions(proj(x_BTD), pos_BT) for proj, conv in projections)
    q_BTHK, k_BTHK = attn.normalize_qk(q.view(B, T, H, Dh), k.view(B, T, H, Dh))
    g_BTHK, beta_BTH = attn.gates(x_BTD)
    o_BTHV = chunk_kda_planned(q_BTHK, k_BTHK, v.view(B, T, H, Dh), g_BTHK, beta_BTH, cu_N1, ci_C2, co_N1, Dh**-0.5)
    return attn.gated_output(o_BTHV, x_BTD)


def _layout_plan(layout: SeqLayout, B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device):
    """The KDA chunk plan of a forward's layout: from its host bounds for packed sequences (once per layout),
    from (B, T) for a padded batch."""
    from kernels.kda.triton.common import plan_chunks

    if cu_seqlens is None:
        return plan_chunks(B, T, None, device)
    return layout.cached("kda_plan", lambda: _prime_kda_plan(B, T, cu_seqlens, layout))


def _prime_kda_plan(B: int, T: int, cu_seqlens: torch.Tensor, layout: SeqLayout):
    """The Triton kernel's chunk plan for this forward's cu_seqlens, built once from the layout's host
    bounds: every KDA layer (forward and backward) then finds it in the plan cache without reading
    cu_seqlens back from the GPU."""
    from kernels.kda.triton.common import padded_chunk_count, plan_chunks

    chunks_to = padded_chunk_count(T, layout.num_seqs) if layout.static else None
    return plan_chunks(B, T, cu_seqlens, cu_seqlens.device, bounds=_host_offsets(layout), chunks_to=chunks_to)


def _host_offsets(layout: SeqLayout) -> list[int]:
    """cu_seqlens of a packed layout (B = 1) from its host bounds, once per layout (every KDA layer asks)."""
    return layout.cached("host_offsets", lambda: [0] + [end for _, _, end in layout.bounds])
