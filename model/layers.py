"""Small building blocks shared by the KDA, MLA and MoE layers.

* ``RMSNorm`` computes in fp32 and casts back (K3 keeps norms in fp32).
* ``ShortConvolution`` is a depthwise causal conv whose weight has nn.Conv1d's layout [C, 1, K]
  (the layout of FLA and vLLM checkpoints), with a conv state in and out and packed (varlen)
  sequences: a token never sees inputs of another sequence, it sees the sequence's conv state
  (or zeros) instead.
* ``GLUMLP`` is a gated MLP with either SiTU-GLU (K3) or SiLU-GLU (SwiGLU) activation. Its ``glu``
  (``GatedActivation``, shared with the routed experts of ``model.moe``)
  goes through ``model.fast`` op "glu": autograd on the ops below (``torch``, the reference), the
  same ops recomputed in backward from gate/up only (``recompute``: bit-exact, the fp32
  intermediates - six [rows, intermediate] buffers for SiTU - are not kept), or the fused Triton
  SiTU-GLU (``triton``, ``kernels.glu``: GPU; SiLU-GLU takes ``recompute`` there).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.transfer import to_device
from model import fast


def f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (fp64 stays fp64, so float64 equivalence tests stay tight)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def cast_once(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x in the compute dtype for several projections, as one copy: each call gives the same bf16 storage
    under a node of its own, whose backward upcasts that consumer's gradient alone, so x's gradient sums the
    consumers' gradients in x's dtype as a cast per nn.Linear gives it (autocast keeps a copy per Linear)."""
    dt = compute_dtype(x)
    if dt == x.dtype:
        return lambda: x
    xc = x.detach().to(dt)
    return lambda: _SharedCast.apply(x, xc)


class _SharedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, xc):
        ctx.dtype = x.dtype
        return xc.view_as(xc)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype), None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What nn.Linear would compute in: the autocast dtype inside autocast, else x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim in fp32, cast back to x's dtype: the math of ``RMSNorm`` as a function of
    its weight, so that one compiled graph serves every norm of a shape (``model.compile``).
    ``F.rms_norm`` is one fused kernel each way on CUDA (the same formula as the op-by-op reference
    ``rms_norm_reference``; on the CPU it is those ops)."""
    x32 = f32(x)  # x and weight in the same dtype: F.rms_norm's fused kernel
    return F.rms_norm(x32, x32.shape[-1:], weight.to(x32.dtype), eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op-by-op RMSNorm the tests hold ``rms_norm`` to."""
    x32 = f32(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * f32(weight)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.norm_fn: Callable = rms_norm  # ``model.compile.compile_regions`` swaps in the compiled one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``model.fast`` op "norm" = recompute: only x is kept for backward, not its fp32 normalised copy."""
        if fast.pick("norm", x.device) == "recompute":
            return recompute_region(self.norm_fn, x, self.weight, self.eps)
        return self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)


def l2_normalize_fused(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x rsqrt(sum x^2 + eps) = D^-1/2 RMSNorm(x; eps / D): the fused RMSNorm kernel on CUDA (one
    launch each way instead of five element-wise ones), equal to ``l2_normalize_reference`` up to fp32
    rounding (not bit for bit: the mean and the D^-1/2 scale round differently)."""
    x32 = f32(x)
    D = x32.shape[-1]
    return (F.rms_norm(x32, (D,), None, eps / D) * D**-0.5).to(x.dtype)


def _l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused form on CUDA, where it saves launches; op by op elsewhere (the CPU's rms_norm is a
    composite of the same ops, so the fused form would only change the rounding there)."""
    return l2_normalize_fused(x, eps) if x.is_cuda else l2_normalize_reference(x, eps)


def l2_normalize_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The op-by-op L2 norm the tests hold ``l2_normalize`` to."""
    x32 = f32(x)
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2 norm over the last dim in fp32 (FLA's l2norm uses eps inside the rsqrt); with ``model.fast``
    op "norm" = recompute only x is kept for backward."""
    if fast.pick("norm", x.device) == "recompute":
        return recompute_in_backward(lambda t: _l2_normalize(t, eps), x)
    return _l2_normalize(x, eps)


def l2_normalize_qk(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norms of a KDA layer's q and k together: one compiled region (``model.compile``)."""
    return _l2_normalize(q, eps), _l2_normalize(k, eps)


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """K3's SiTU-GLU in fp32: [beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)]; |h| <= 100."""
    g32, u32 = f32(gate), f32(up)
    h = beta * torch.tanh(g32 / beta) * torch.sigmoid(g32) * (linear_beta * torch.tanh(u32 / linear_beta))
    return h.to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def glu_activation(
    gate: torch.Tensor, up: torch.Tensor, act: str, beta: float, linear_beta: float
) -> torch.Tensor:
    """``act`` ("situ" or "silu") of (gate, up) as a function of plain arguments: one compiled graph per
    (act, betas, dtype, rank) serves every expert and dense MLP (``model.compile``)."""
    return situ_glu(gate, up, beta, linear_beta) if act == "situ" else silu_glu(gate, up)


class GatedActivation:
    """The gated activation act(g, u) of a GLU, shared by ``GLUMLP`` and the routed experts
    (``model.moe.GroupedExperts``): "situ" (K3) or "silu", through ``model.fast`` op "glu"."""

    act: str
    situ_betas: tuple[float, float]
    glu_fn: Callable

    def _init_activation(self, act: str, situ_betas) -> None:
        if act not in ("situ", "silu"):
            raise ValueError(f"GLU activation must be 'situ' or 'silu', got {act!r}")
        self.act = act
        self.situ_betas = tuple(situ_betas)
        self.glu_fn = glu_activation  # ``model.compile.compile_regions`` swaps in the compiled one

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The gated activation of (gate_proj x, up_proj x), through ``model.fast`` op "glu"."""
        choice = fast.pick("glu", g.device)
        # training only: without gradient there is nothing to save, and inference graphs (vLLM's
        # compiled and captured forward) keep the plain ops
        if choice == "triton" and self.act == "situ" and g.is_cuda and torch.is_grad_enabled():
            from kernels.glu import situ_glu_fused

            return situ_glu_fused(g, u, *self.situ_betas)
        if choice != "torch":
            return recompute_region(self.glu_fn, g, u, self.act, *self.situ_betas)
        return self.glu_torch(g, u)

    def glu_torch(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The reference activation (autograd keeps its intermediates); ``model.compile`` compiles it."""
        return self.glu_fn(g, u, self.act, *self.situ_betas)


class GLUMLP(GatedActivation, nn.Module):
    """down_proj(act(gate_proj x, up_proj x)); used for dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, act: str = "situ", situ_betas=(4.0, 25.0)) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._init_activation(act, situ_betas)
        # the rollout engine's fused [gate; up] weight, whose rows the two projections' weights are views of
        # (``model.serving.fuse_feed_forward_inputs``): one GEMM for both; None in training
        self.gate_up_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            return self.down_proj(self.glu(*F.linear(x, self.gate_up_weight).chunk(2, dim=-1)))
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


def recompute_in_backward(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)`` whose backward reruns ``fn`` instead of keeping its intermediates: for
    element-wise regions, where memory, not compute, is the price (non-reentrant checkpointing:
    nests inside a checkpointed layer, and the recomputation replays the autocast state). Without
    gradient it is a plain call."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def recompute_region(region: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``region(*args)`` keeping only what its backward needs. A compiled region (``model.compile.
    CompiledOrEager``, not fallen back to eager) does that by itself: AOTAutograd's partitioner saves the
    graph's inputs and per-row statistics and recomputes the element-wise rest inside the compiled backward
    (inductor: an RMSNorm's graph keeps its input tensor itself and the rows' rstd, ``tests/model/
    test_compile.py``), so it is called directly: one compiled forward call, where the checkpoint's
    recomputation is a second one. Anything else goes through ``recompute_in_backward``. Not for a region
    whose graph would keep a new copy of its inputs (the AttnRes mixes stack theirs: ``AttnResMix``)."""
    from model.compile import CompiledOrEager

    if isinstance(region, CompiledOrEager) and region.failed is None:
        return region(*args)
    return recompute_in_backward(region, *args)


# ---------------------------------------------------------------------------- sequences
@dataclass
class SeqLayout:
    """Where each token sits: its sequence (state row) and its position inside that sequence.

    seq_BT indexes the state rows [N, ...]; pos_BT counts from 0 at each sequence start.
    For padded input N = B; for packed input (B = 1) N = len(cu_seqlens) - 1.
    Built once per forward (``seq_layout``) from a host copy of cu_seqlens: the layers read the
    host ``bounds`` and the device tensors here, never cu_seqlens on the host themselves.
    ``cu_seqlens_N1`` (int32, device) treats padded rows as sequences of the flattened [B*T] axis;
    ``cache`` holds what the layers derive from the layout once per forward (attention masks,
    int32 positions), so every layer of a forward shares it.
    """

    seq_BT: torch.Tensor
    pos_BT: torch.Tensor
    bounds: list[tuple[int, int, int]]  # (batch row, start, end) per sequence, in state order
    cu_seqlens_N1: torch.Tensor | None = None
    max_len: int = 0
    static: bool = False  # shapes fixed by (B, T, num_seqs) alone: max_len = T, KDA chunk plans padded
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.bounds)

    def cached(self, key, build):
        """``build()`` once per layout (per forward), then the same object for every layer."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def positions_i32(self) -> torch.Tensor:
        """``pos_BT`` as contiguous int32 (what the Triton convolutions read), once per layout."""
        return self.cached("pos_i32", lambda: self.pos_BT.to(torch.int32).contiguous())


def seq_layout(
    B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device, static: bool = False
) -> SeqLayout:
    """The layout of a forward. Pass cu_seqlens as a CPU tensor to build it without a device sync
    (a device cu_seqlens is read on the host once here). ``static``: every shape and plain number the layers
    pass to their kernels follows from (B, T, number of sequences) alone -- ``max_len`` is T (an upper bound for
    varlen attention) and the KDA chunk plan is padded to its largest size -- so compiled layers replay as CUDA
    graphs across micro-batches whose sequences differ (a learner pads T and the sequence count to buckets)."""
    if cu_seqlens is None:
        seq_BT = torch.arange(B, device=device)[:, None].expand(B, T)
        pos_BT = torch.arange(T, device=device)[None, :].expand(B, T)
        cu_N1 = torch.arange(B + 1, device=device, dtype=torch.int32) * T
        return SeqLayout(seq_BT, pos_BT, [(b, 0, T) for b in range(B)], cu_N1, T)
    if B != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {B}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-d tensor of offsets, got shape {tuple(cu_seqlens.shape)}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T = {T}, got {cu}")
    cu_N1 = to_device(torch.tensor(cu, dtype=torch.int32), device)  # the one host-to-device copy
    lengths_N = (cu_N1[1:] - cu_N1[:-1]).long()
    seq_T = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), lengths_N, output_size=T)
    pos_T = torch.arange(T, device=device) - cu_N1[:-1].long()[seq_T]
    max_len = T if static else max((b - a for a, b in itertools.pairwise(cu)), default=0)
    bounds = [(0, a, b) for a, b in itertools.pairwise(cu)]
    return SeqLayout(seq_T[None], pos_T[None], bounds, cu_N1, max_len, static)


# model.fast op "conv" choices on the Triton kernel -> its backward (``kernels.conv.triton.BACKWARD_KERNELS``)
CONV_BACKWARDS = {"triton": "two_pass", "triton_fused": "fused", "triton_bf16": "two_pass_bf16"}


class ShortConvolution(nn.Module):
    """Depthwise causal conv (kernel K) + optional SiLU, with a conv state of the last K-1 inputs.

    conv state layout: [N, C, K-1], oldest input first, matching vLLM's causal_conv1d state.
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu") -> None:
        super().__init__()
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.activation = activation
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(
        self,
        x_BTC: torch.Tensor,
        layout: SeqLayout,
        conv_state_NCW: torch.Tensor | None = None,
        need_state: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (y_BTC, final conv state [N, C, K-1], None unless ``need_state``).

        ``model.fast`` op "conv" may pick a one-launch Triton kernel (``kernels.conv``) for the output:
        without a conv state in or out (training, prefill from scratch) the differentiable one; with a state
        or a final state asked for, outside autograd (the engine's prefill) the one that reads the conv
        states. The taps below are the reference.
        """
        triton_ok = (conv_state_NCW is None and not need_state) or not torch.is_grad_enabled()
        if triton_ok and fast.pick("conv", x_BTC.device) in CONV_BACKWARDS:
            y_BTC = self._conv_triton(x_BTC, layout, conv_state_NCW)
        else:
            y_BTC = self._conv_taps(x_BTC, layout, conv_state_NCW)
        return y_BTC, self._final_state(x_BTC, layout, conv_state_NCW) if need_state else None

    def _conv_triton(self, x_BTC: torch.Tensor, layout: SeqLayout, conv_state_NCW) -> torch.Tensor:
        from kernels.conv import causal_conv1d_state_triton

        pos_BT = layout.positions_i32()
        if conv_state_NCW is None:
            return self.conv_positions(x_BTC, pos_BT)
        seq_BT = layout.cached("seq_i32", lambda: layout.seq_BT.to(torch.int32).contiguous())
        return causal_conv1d_state_triton(x_BTC, self.weight[:, 0, :], pos_BT, seq_BT, conv_state_NCW, self.activation)

    def conv_positions(self, x_BTC: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
        """The differentiable Triton conv without a conv state, given int32 positions (``SeqLayout.positions_i32``):
        what the learner's compiled KDA layer calls (``model.kda.kda_planned_forward``)."""
        from kernels.conv import causal_conv1d_triton

        backward = CONV_BACKWARDS.get(fast.pick("conv", x_BTC.device))  # None: the kernel's default
        return causal_conv1d_triton(x_BTC, self.weight[:, 0, :], pos_BT, self.activation, backward)

    def _conv_taps(self, x_BTC: torch.Tensor, layout: SeqLayout, conv_state_NCW) -> torch.Tensor:
        K, W = self.kernel_size, self.kernel_size - 1
        _B, T, _C = x_BTC.shape
        w_CK = self.weight[:, 0, :].to(x_BTC.dtype)
        y_BTC = x_BTC * w_CK[:, K - 1]
        for j in range(1, K):  # tap j reads the input j steps back
            shifted_BTC = F.pad(x_BTC, (0, 0, j, 0))[:, :T]
            inside_BT1 = (layout.pos_BT >= j)[..., None]
            if conv_state_NCW is not None:
                idx_BT = (W + layout.pos_BT - j).clamp(min=0, max=max(W - 1, 0))  # masked where inside
                from_state_BTC = conv_state_NCW.to(x_BTC.dtype)[layout.seq_BT, :, idx_BT]
                shifted_BTC = torch.where(inside_BT1, shifted_BTC, from_state_BTC)
            else:
                shifted_BTC = shifted_BTC * inside_BT1
            y_BTC = y_BTC + shifted_BTC * w_CK[:, K - 1 - j]
        if self.activation == "silu":
            y_BTC = F.silu(y_BTC)
        return y_BTC

    def _final_state(self, x_BTC, layout: SeqLayout, conv_state_NCW) -> torch.Tensor:
        """[N, C, W]: each sequence's last W inputs, oldest first, taken from its conv state where the
        sequence is shorter than W; a few gathers for all sequences at once (``final_state_reference``:
        the same values sequence by sequence, as this was written until 2026-12-04: 3 launches a sequence,
        thousands a prefill step of 64 sequences in the engine)."""
        W, C = self.kernel_size - 1, x_BTC.shape[-1]
        if W == 0 or not layout.bounds:
            return x_BTC.new_zeros(len(layout.bounds), C, W)
        b_N1, tok_NW, inside_NW1, rows_N1, col_NW = layout.cached(
            ("final_state_index", W), lambda: _final_state_index(layout.bounds, W, x_BTC.device)
        )
        from_x_NWC = x_BTC[b_N1, tok_NW]
        if conv_state_NCW is None:  # zeros before the sequence (a select: an inf there stays out, as in the reference)
            from_state_NWC = from_x_NWC.new_zeros(())
        else:
            from_state_NWC = conv_state_NCW.to(x_BTC.dtype)[rows_N1, :, col_NW]
        final_NWC = torch.where(inside_NW1, from_x_NWC, from_state_NWC)
        return final_NWC.transpose(1, 2).contiguous()


def _final_state_index(bounds: list[tuple[int, int, int]], W: int, device) -> tuple[torch.Tensor, ...]:
    """Where each sequence's last W inputs are (``ShortConvolution._final_state``), once per layout for every
    layer and convolution: its batch row [N, 1], the window's tokens in that row [N, W] (clamped at 0), whether
    each lies inside the sequence [N, W, 1], and otherwise the conv state's row [N, 1] and column [N, W] that
    holds it (token start - i sits in column W - i). Built on the host, one copy to the device."""
    b_N, start_N, end_N = torch.tensor(bounds, dtype=torch.long).reshape(-1, 3).unbind(1)
    tok_NW = end_N[:, None] - W + torch.arange(W)
    inside_NW = tok_NW >= start_N[:, None]
    col_NW = (W + tok_NW - start_N[:, None]).clamp(0, W - 1)
    rows_N = torch.arange(len(bounds))
    packed = torch.cat([b_N[:, None], tok_NW.clamp(min=0), inside_NW.long(), rows_N[:, None], col_NW], dim=1)
    b_N1, tok, inside, rows_N1, col = to_device(packed, device).split([1, W, W, 1, W], dim=1)
    return b_N1, tok, inside.bool()[..., None], rows_N1, col


def final_state_reference(x_BTC, layout: SeqLayout, conv_state_NCW, W: int) -> torch.Tensor:
    """``ShortConvolution._final_state`` one sequence at a time: its conv state, then its inputs, the last W."""
    finals = []
    for n, (b, start, end) in enumerate(layout.bounds):
        prev_CW = conv_state_NCW[n].to(x_BTC.dtype) if conv_state_NCW is not None else x_BTC.new_zeros(x_BTC.shape[-1], W)
        extended_CL = torch.cat([prev_CW, x_BTC[b, start:end].transpose(0, 1)], dim=1)
        finals.append(extended_CL[:, extended_CL.shape[1] - W :])
    return torch.stack(finals)
