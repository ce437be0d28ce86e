"""Triton varlen causal depthwise conv1d (kernel K, optional SiLU) with its backward.

Tokens are one flat axis of R rows (a packed [1, T] batch or a padded [B, T] one flattened): every
row carries its position inside its sequence, and tap j reads row r - j only where pos[r] >= j, so
one launch covers every sequence of a micro-batch with no per-sequence loop. fp32 accumulation,
taps in the reference's order (tests/kernels/test_conv.py holds it to ``naive.py``).

Backward, two kernels over (row block, channel block): ``_conv_dpre`` writes dpre[r] = dy[r] act'(pre[r])
(pre recomputed from x, K taps) to an [R, C] buffer in x's dtype (with no activation dpre is dy and this pass
is skipped), then ``_conv_bwd`` reads it: dx[r] = sum_j w[K-1-j] dpre[r+j] [pos[r+j] >= j] (the rows
r + j of the same sequence), and per-block partial sums of dw[K-1-j] = sum_r dpre[r] x[r-j]
[pos[r] >= j], added on the host side of the launch (a [blocks, C, K] fp32 buffer, then a sum). One
fused kernel that recomputed dpre for each of the K shifted row sets (K + 1 recomputations of K taps)
took 284 us a call on the H200 against 37 us for the forward (gpu_1b, 16K tokens, C = 1024); the two
passes take 59 + 102 us (bench/RESULTS.md, 2026-12-03). ``BACKWARD_KERNELS`` names the default, "two_pass_bf16"
(dpre in x's dtype: bf16 under the learner's autocast, 12 bytes of traffic an element instead of 16, one more
rounding of dpre; a gpu_1b step's 36 backwards 6.3 -> 5.3 ms on an H100, bench/RESULTS.md 2026-12-06), and the A/B
variants: "two_pass" (dpre in fp32, the default until then) and "fused" (both passes in one kernel, dpre in a
per-program scratch tile).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.op_names import op_name

BLOCK_R = 64
BLOCK_C = 64


@dataclasses.dataclass(frozen=True)
class Launch:
    """A kernel's tile (rows x channels) and warps: the ops' defaults below; ``bench/learner_kernels.py`` sweeps
    others through ``conv_rows_fwd`` / ``conv_rows_bwd``."""

    block_r: int = BLOCK_R
    block_c: int = BLOCK_C
    warps: int = 4

    def grid(self, R: int, C: int) -> tuple[int, int]:
        return (triton.cdiv(R, self.block_r), triton.cdiv(C, self.block_c))


FWD_LAUNCH = Launch()
BWD_LAUNCH = Launch()
# tl.zeros / tl.sigmoid / tl.sum are @jit functions of triton.language.standard, which the interpreter
# runs only if TRITON_INTERPRET was set before triton was imported: builtins and tl.reduce instead
# (as kernels/kda/triton/common.py does), so the tests can interpret this module whenever it is imported.
_sum_combine = tl.standard._sum_combine


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _pre(x_ptr, w_ptr, pos_ptr, r, rm, c, cm, R, C, K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Pre-activation [BR, BC] in fp32 at rows r."""
    pos = tl.load(pos_ptr + r, mask=rm & (r < R), other=0)
    acc = tl.full([BR, BC], 0.0, dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + c * K + (K - 1 - j), mask=cm, other=0.0).to(tl.float32)
        src = r - j
        m = (rm & (pos >= j))[:, None] & cm[None, :]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += xv * w[None, :]
    return acc


@triton.jit
def _conv_fwd(x_ptr, w_ptr, pos_ptr, y_ptr, R, C, K: tl.constexpr, SILU: tl.constexpr,
              BR: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    rm, cm = r < R, c < C
    acc = _pre(x_ptr, w_ptr, pos_ptr, r, rm, c, cm, R, C, K, BR, BC)
    if SILU:
        acc = acc * _sigmoid(acc)
    offs = r.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])


@triton.jit
def _conv_dpre(x_ptr, w_ptr, pos_ptr, dy_ptr, dpre_ptr, R, C, K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """dpre = dy * silu'(pre) in fp32, pre recomputed from x (the activation's case only)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    rm, cm = r < R, c < C
    dpre = _dpre(x_ptr, w_ptr, pos_ptr, dy_ptr, r, rm, c, cm, R, C, K, True, BR, BC)
    tl.store(dpre_ptr + r.to(tl.int64)[:, None] * C + c[None, :], dpre.to(dpre_ptr.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])  # fmt: skip


@triton.jit
def _conv_bwd(x_ptr, w_ptr, pos_ptr, dpre_ptr, dx_ptr, dw_ptr, R, C, K: tl.constexpr, BR: tl.constexpr,
              BC: tl.constexpr):  # fmt: skip
    """dx and the block's dw partial sums from dpre (any float dtype, read as fp32)."""
    pid_r = tl.program_id(0)
    r = pid_r * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    rm, cm = r < R, c < C
    dx = _dx(dpre_ptr + (pid_r * BR).to(tl.int64) * C, C, c, w_ptr, pos_ptr, r, c, cm, R, K, BR, BC)
    tl.store(dx_ptr + r.to(tl.int64)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])  # fmt: skip
    mr = rm[:, None] & cm[None, :]
    dpre_r = tl.load(dpre_ptr + r.to(tl.int64)[:, None] * C + c[None, :], mask=mr, other=0.0).to(tl.float32)
    _dw_parts(x_ptr, pos_ptr, dw_ptr, dpre_r, pid_r, r, rm, c, cm, C, K)


@triton.jit
def _conv_bwd_fused(x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dw_ptr, scratch_ptr, R, C, K: tl.constexpr,
                    SILU: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HALO: tl.constexpr):  # fmt: skip
    """Both passes in one program: dpre for the block's rows and the K - 1 rows after them (the halo, recomputed
    by the next block too) kept in this program's own fp32 scratch tile, then dx read from it shifted by each
    tap after a barrier (the tile stays in cache: no [R, C] round trip, one launch), dw from the block's rows."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BR + tl.arange(0, BR)
    h = pid_r * BR + BR + tl.arange(0, HALO)
    c = pid_c * BC + tl.arange(0, BC)
    rm, cm = r < R, c < C
    hm = (h < R) & (h < pid_r * BR + BR + K - 1)
    dpre_r = _dpre(x_ptr, w_ptr, pos_ptr, dy_ptr, r, rm, c, cm, R, C, K, SILU, BR, BC)
    dpre_h = _dpre(x_ptr, w_ptr, pos_ptr, dy_ptr, h, hm, c, cm, R, C, K, SILU, HALO, BC)
    tile = scratch_ptr + (pid_r * tl.num_programs(1) + pid_c).to(tl.int64) * ((BR + HALO) * BC)
    lr, lh, lc = tl.arange(0, BR), BR + tl.arange(0, HALO), tl.arange(0, BC)  # the tile's rows and columns
    tl.store(tile + lr[:, None] * BC + lc[None, :], dpre_r)
    tl.store(tile + lh[:, None] * BC + lc[None, :], dpre_h)
    tl.debug_barrier()  # the tile written by every thread of the program before any reads it shifted
    dx = _dx(tile, BC, lc, w_ptr, pos_ptr, r, c, cm, R, K, BR, BC)
    tl.store(dx_ptr + r.to(tl.int64)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])  # fmt: skip
    _dw_parts(x_ptr, pos_ptr, dw_ptr, dpre_r, pid_r, r, rm, c, cm, C, K)


@triton.jit
def _dx(rows_ptr, stride, cols, w_ptr, pos_ptr, r, c, cm, R, K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """dx [BR, BC] at rows r = r0 + [0, BR): sum_j w[K-1-j] dpre[r + j] [pos[r + j] >= j] (row r feeds tap j of
    row r + j in the same sequence), dpre's row r0 + i at ``rows_ptr + i * stride + cols`` (fp32 or any float)."""
    dx = tl.full([BR, BC], 0.0, dtype=tl.float32)
    for j in tl.static_range(K):
        s = r + j
        pos_s = tl.load(pos_ptr + s, mask=s < R, other=0)
        m = ((s < R) & (pos_s >= j))[:, None] & cm[None, :]
        local = tl.arange(0, BR) + j
        d = tl.load(rows_ptr + local.to(tl.int64)[:, None] * stride + cols[None, :], mask=m, other=0.0)
        w = tl.load(w_ptr + c * K + (K - 1 - j), mask=cm, other=0.0).to(tl.float32)
        dx += d.to(tl.float32) * w[None, :]
    return dx


@triton.jit
def _dpre(x_ptr, w_ptr, pos_ptr, dy_ptr, r, rm, c, cm, R, C, K: tl.constexpr, SILU: tl.constexpr, BR: tl.constexpr,
          BC: tl.constexpr):  # fmt: skip
    """dpre [BR, BC] fp32 at rows r (zero where masked): dy * silu'(pre), pre recomputed; dy itself without SILU."""
    m = rm[:, None] & cm[None, :]
    dy = tl.load(dy_ptr + r.to(tl.int64)[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre(x_ptr, w_ptr, pos_ptr, r, rm, c, cm, R, C, K, BR, BC)
        sig = _sigmoid(pre)
        dy = dy * sig * (1.0 + pre * (1.0 - sig))
    return dy


@triton.jit
def _dw_parts(x_ptr, pos_ptr, dw_ptr, dpre_r, pid_r, r, rm, c, cm, C, K: tl.constexpr):
    """The block's partial sums dw[K-1-j] = sum_r dpre[r] x[r-j] [pos[r] >= j], one row of the [blocks, C, K]
    buffer."""
    pos_r = tl.load(pos_ptr + r, mask=rm, other=0)
    for j in tl.static_range(K):
        m = (rm & (pos_r >= j))[:, None] & cm[None, :]
        xv = tl.load(x_ptr + (r - j).to(tl.int64)[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        part = tl.reduce(dpre_r * xv, 0, _sum_combine)
        tl.store(dw_ptr + (pid_r.to(tl.int64) * C + c) * K + (K - 1 - j), part, mask=cm)


@torch.library.custom_op(op_name("conv_varlen_fwd"), mutates_args=())
def conv_varlen_fwd(x_RC: torch.Tensor, w_CK: torch.Tensor, pos_R: torch.Tensor, silu: bool) -> torch.Tensor:
    """y [R, C] of contiguous rows x, weight w [C, K] and int32 positions: one launch. A custom op, so that a
    compiled graph (the learner's KDA block) calls it as it is rather than launching the kernel itself."""
    return conv_rows_fwd(x_RC, w_CK, pos_R, silu)


def conv_rows_fwd(x_RC, w_CK, pos_R, silu: bool, launch: Launch = FWD_LAUNCH) -> torch.Tensor:
    """``conv_varlen_fwd``'s launch, its tile and warps given."""
    R, C = x_RC.shape
    y_RC = torch.empty_like(x_RC)
    if y_RC.numel():
        _conv_fwd[launch.grid(R, C)](x_RC, w_CK, pos_R, y_RC, R, C, K=w_CK.shape[1], SILU=silu, BR=launch.block_r,
                                     BC=launch.block_c, num_warps=launch.warps)  # fmt: skip
    return y_RC


@conv_varlen_fwd.register_fake
def _(x_RC, w_CK, pos_R, silu):
    return torch.empty_like(x_RC)


BACKWARD_KERNELS = ("two_pass_bf16", "two_pass", "fused")  # the default first; the module docstring has the others


def _check_backward(kernel: str) -> None:
    if kernel not in BACKWARD_KERNELS:
        raise ValueError(f"backward must be one of {BACKWARD_KERNELS}, got {kernel!r}")


@torch.library.custom_op(op_name("conv_varlen_bwd"), mutates_args=())
def conv_varlen_bwd(
    x_RC: torch.Tensor, w_CK: torch.Tensor, pos_R: torch.Tensor, dy_RC: torch.Tensor, silu: bool, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [R, C], dw [C, K] in w's dtype) for the output gradient dy, by ``kernel`` (``BACKWARD_KERNELS``): the
    two passes of the module docstring, both in one launch (``_conv_bwd_fused``), or the two passes with dpre
    in x's dtype."""
    return conv_rows_bwd(x_RC, w_CK, pos_R, dy_RC, silu, kernel)


def conv_rows_bwd(x_RC, w_CK, pos_R, dy_RC, silu: bool, kernel: str, launch: Launch = BWD_LAUNCH):
    """``conv_varlen_bwd``'s launches, their tile and warps given (one ``Launch`` for both passes)."""
    _check_backward(kernel)
    R, C = x_RC.shape
    K = w_CK.shape[1]
    dx_RC = torch.empty_like(x_RC)
    if not dx_RC.numel():
        return dx_RC, torch.zeros_like(w_CK)
    grid, BR, BC, warps = launch.grid(R, C), launch.block_r, launch.block_c, launch.warps
    dy_RC = dy_RC.contiguous()
    dw_part = torch.empty(grid[0], C, K, device=x_RC.device, dtype=torch.float32)
    if kernel == "fused":
        halo = triton.next_power_of_2(max(K - 1, 1))
        scratch = torch.empty(grid[0] * grid[1] * (BR + halo) * BC, device=x_RC.device, dtype=torch.float32)
        _conv_bwd_fused[grid](x_RC, w_CK, pos_R, dy_RC, dx_RC, dw_part, scratch, R, C, K=K, SILU=silu, BR=BR, BC=BC,
                              HALO=halo, num_warps=warps)  # fmt: skip
        return dx_RC, dw_part.sum(0).to(w_CK.dtype)
    dpre_RC = dy_RC
    if silu:
        dpre_dtype = x_RC.dtype if kernel == "two_pass_bf16" else torch.float32
        dpre_RC = torch.empty(R, C, device=x_RC.device, dtype=dpre_dtype)
        _conv_dpre[grid](x_RC, w_CK, pos_R, dy_RC, dpre_RC, R, C, K=K, BR=BR, BC=BC, num_warps=warps)
    _conv_bwd[grid](x_RC, w_CK, pos_R, dpre_RC, dx_RC, dw_part, R, C, K=K, BR=BR, BC=BC, num_warps=warps)
    return dx_RC, dw_part.sum(0).to(w_CK.dtype)


@conv_varlen_bwd.register_fake
def _(x_RC, w_CK, pos_R, dy_RC, silu, kernel):
    return torch.empty_like(x_RC), torch.empty_like(w_CK)


class CausalConv1dVarlen(torch.autograd.Function):
    """The differentiable conv over the two ops: nothing but them inside, so dynamo traces it into a graph."""

    @staticmethod
    def forward(ctx, x_RC, w_CK, pos_R, silu: bool, backward: str):
        ctx.save_for_backward(x_RC, w_CK, pos_R)
        ctx.silu, ctx.backward = silu, backward
        return conv_varlen_fwd(x_RC, w_CK, pos_R, silu)

    @staticmethod
    def backward(ctx, dy_RC):
        x_RC, w_CK, pos_R = ctx.saved_tensors
        dx_RC, dw_CK = conv_varlen_bwd(x_RC, w_CK, pos_R, dy_RC, ctx.silu, ctx.backward)
        return dx_RC, dw_CK, None, None, None


def causal_conv1d_triton(
    x_BTC: torch.Tensor, w_CK: torch.Tensor, pos_BT: torch.Tensor, activation: str | None = "silu",
    backward: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Same function as ``kernels.conv.naive.causal_conv1d_naive`` (fp32 accumulation); ``backward`` one of
    ``BACKWARD_KERNELS`` (None: the default, its first)."""
    backward = BACKWARD_KERNELS[0] if backward is None else backward
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    _check_backward(backward)  # here, not first in backward: a bad name fails the forward call
    B, T, C = x_BTC.shape
    if tuple(w_CK.shape[:1]) != (C,) or w_CK.ndim != 2:
        raise ValueError(f"weight must be [C, K] = [{C}, K], got {tuple(w_CK.shape)}")
    if tuple(pos_BT.shape) != (B, T):
        raise ValueError(f"positions must be [B, T] = [{B}, {T}], got {tuple(pos_BT.shape)}")
    pos_R = pos_BT.reshape(-1).to(torch.int32)
    y = CausalConv1dVarlen.apply(
        x_BTC.reshape(B * T, C).contiguous(), w_CK.contiguous(), pos_R, activation == "silu", backward
    )
    return y.view(B, T, C)


@triton.jit(do_not_specialize=["R"])  # one compile for every token count (model.kernel_warmup's child compiles it)
def _conv_fwd_state(x_ptr, w_ptr, pos_ptr, seq_ptr, state_ptr, y_ptr, R, C, ss0, ss1, ss2, K: tl.constexpr,
                    SILU: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """``_conv_fwd`` continuing from conv states: tap j of a row at position pos < j reads its sequence's
    state column K - 1 + pos - j (the input j - pos steps before the sequence), cast to x's dtype as the
    reference's taps cast the state; fp32 accumulation in the taps' order."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    rm, cm = r < R, c < C
    pos = tl.load(pos_ptr + r, mask=rm, other=0)
    seq = tl.load(seq_ptr + r, mask=rm, other=0).to(tl.int64)
    acc = tl.full([BR, BC], 0.0, dtype=tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + c * K + (K - 1 - j), mask=cm, other=0.0).to(tl.float32)
        m = (rm & (pos >= j))[:, None] & cm[None, :]
        xv = tl.load(x_ptr + (r - j).to(tl.int64)[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        if j > 0:
            ms = (rm & (pos < j))[:, None] & cm[None, :]
            col = (K - 1 + pos - j).to(tl.int64)
            sv = tl.load(state_ptr + seq[:, None] * ss0 + c.to(tl.int64)[None, :] * ss1 + col[:, None] * ss2,
                         mask=ms, other=0.0)  # fmt: skip
            xv += sv.to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += xv * w[None, :]
    if SILU:
        acc = acc * _sigmoid(acc)
    offs = r.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])


def causal_conv1d_state_triton(
    x_BTC: torch.Tensor, w_CK: torch.Tensor, pos_BT: torch.Tensor, seq_BT: torch.Tensor, state_NCW: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:  # fmt: skip
    """``causal_conv1d_triton`` continuing each sequence from its conv state [N, C, K-1] (oldest first;
    ``seq_BT``: each token's state row): the rollout engine's prefill over kept sessions, one launch where the
    reference (``model.layers.ShortConvolution._conv_taps``) gathers and selects per tap. Forward only."""
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    B, T, C = x_BTC.shape
    K = w_CK.shape[-1]
    if w_CK.ndim != 2 or w_CK.shape[0] != C or tuple(pos_BT.shape) != (B, T) or tuple(seq_BT.shape) != (B, T) \
            or state_NCW.ndim != 3 or tuple(state_NCW.shape[1:]) != (C, K - 1):  # fmt: skip
        raise ValueError(f"conv with state: x [B, T, C] = {tuple(x_BTC.shape)}, w [C, K] = {tuple(w_CK.shape)}, "
                         f"pos and seq [B, T] = {tuple(pos_BT.shape)} and {tuple(seq_BT.shape)}, "
                         f"state [N, C, K-1] = {tuple(state_NCW.shape)}")  # fmt: skip
    R = B * T
    x_RC = x_BTC.reshape(R, C).contiguous()
    y_RC = torch.empty_like(x_RC)
    if R:
        _conv_fwd_state[Launch().grid(R, C)](
            x_RC, w_CK.contiguous(), pos_BT.reshape(-1).to(torch.int32), seq_BT.reshape(-1).to(torch.int32),
            state_NCW, y_RC, R, C, *state_NCW.stride(), K=K, SILU=activation == "silu", BR=BLOCK_R, BC=BLOCK_C,
        )  # fmt: skip
    return y_RC.view(B, T, C)


@triton.jit
def _conv_state_step_part(x_ptr, w_ptr, state_ptr, y_ptr, n, slot, c, cm, C, sx, s0, s1, s2, K: tl.constexpr,
                          SILU: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """One sequence's decode step over a block of channels of one conv: the window read from its state slot, the
    new input appended, the output written and the window shifted in place (padding slots: zero output)."""
    x = tl.load(x_ptr + n.to(tl.int64) * sx + c, mask=cm, other=0.0)
    acc = tl.full([BC], 0.0, dtype=tl.float32)
    if slot >= 0:
        base = state_ptr + slot * s0 + c.to(tl.int64) * s1
        acc = x.to(tl.float32) * tl.load(w_ptr + c * K + (K - 1), mask=cm, other=0.0).to(tl.float32)
        for j in tl.static_range(K - 1):  # window entry j (oldest first) meets weight column j
            s = tl.load(base + j * s2, mask=cm, other=0.0)
            acc += s.to(tl.float32) * tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
        for j in tl.static_range(K - 2):  # shift left: entry j takes entry j + 1, read before it is written
            tl.store(base + j * s2, tl.load(base + (j + 1) * s2, mask=cm, other=0.0), mask=cm)
        tl.store(base + (K - 2) * s2, x.to(state_ptr.dtype.element_ty), mask=cm)
        if SILU:
            acc = acc * _sigmoid(acc)
    tl.store(y_ptr + n.to(tl.int64) * C + c, acc.to(y_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _conv_state_step(x0_ptr, w0_ptr, state0_ptr, y0_ptr, x1_ptr, w1_ptr, state1_ptr, y1_ptr,
                     x2_ptr, w2_ptr, state2_ptr, y2_ptr, slot_ptr, C, sx, s0, s1, s2, K: tl.constexpr,
                     SILU: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Program (sequence, channel block, part): the decode step of up to three convs of one shape and layout (the
    KDA layer's q, k and v) in one launch; part p of the grid's third axis steps the p-th (x, w, state, y)."""
    n, part = tl.program_id(0), tl.program_id(2)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if part == 0:
        _conv_state_step_part(x0_ptr, w0_ptr, state0_ptr, y0_ptr, n, slot, c, cm, C, sx, s0, s1, s2, K, SILU, BC)
    elif part == 1:
        _conv_state_step_part(x1_ptr, w1_ptr, state1_ptr, y1_ptr, n, slot, c, cm, C, sx, s0, s1, s2, K, SILU, BC)
    else:
        _conv_state_step_part(x2_ptr, w2_ptr, state2_ptr, y2_ptr, n, slot, c, cm, C, sx, s0, s1, s2, K, SILU, BC)


def conv_state_step_triton_(
    x_NC: torch.Tensor, state_PCW: torch.Tensor, slots_N: torch.Tensor, w_CK: torch.Tensor, silu: bool
) -> torch.Tensor:
    """``kernels.conv.naive.conv_state_step_naive_`` in one launch, fp32 accumulation, nothing read back to
    the host (safe inside a captured CUDA graph). x: [N, C] with a contiguous last dim; state: any strides."""
    return conv_state_steps_triton_((x_NC,), (state_PCW,), slots_N, (w_CK,), silu)[0]


def conv_state_steps_triton_(
    xs_NC: Sequence[torch.Tensor], states_PCW: Sequence[torch.Tensor], slots_N: torch.Tensor,
    ws_CK: Sequence[torch.Tensor], silu: bool,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``conv_state_step_triton_`` of one to three convs over the same slots, in one launch when their inputs share a
    row stride and their states a layout (the KDA layer's q, k and v: column slices of one projection, states in
    one page layout), else one launch each."""
    if not 1 <= len(xs_NC) == len(states_PCW) == len(ws_CK) <= 3:
        raise ValueError(f"conv_state_steps: one to three (x, state, w) each, got {len(xs_NC)}, {len(states_PCW)} "
                         f"and {len(ws_CK)}")  # fmt: skip
    for x_NC, state_PCW, w_CK in zip(xs_NC, states_PCW, ws_CK):
        _check_step(x_NC, state_PCW, slots_N, w_CK)
    same = all(x.shape == xs_NC[0].shape and x.stride() == xs_NC[0].stride() for x in xs_NC) and all(
        st.shape == states_PCW[0].shape and st.stride() == states_PCW[0].stride() for st in states_PCW
    )
    if not same:
        return tuple(conv_state_steps_triton_((x,), (st,), slots_N, (w,), silu)[0]
                     for x, st, w in zip(xs_NC, states_PCW, ws_CK))  # fmt: skip
    N, C = xs_NC[0].shape
    K = ws_CK[0].shape[1]
    ys = tuple(torch.empty_like(x) for x in xs_NC)
    if N:
        bc = min(256, triton.next_power_of_2(C))
        pad = 3 - len(xs_NC)  # unused pointer sets: the first part's, never read (the grid has no such part)
        parts = [(x, w.contiguous(), st, y) for x, w, st, y in zip(xs_NC, ws_CK, states_PCW, ys)]
        args = [t for part in parts + parts[:1] * pad for t in part]
        _conv_state_step[(N, triton.cdiv(C, bc), len(parts))](
            *args, slots_N, C, xs_NC[0].stride(0), *states_PCW[0].stride(), K=K, SILU=silu, BC=bc
        )
    return ys


def _check_step(x_NC: torch.Tensor, state_PCW: torch.Tensor, slots_N: torch.Tensor, w_CK: torch.Tensor) -> None:
    N, C = x_NC.shape
    K = w_CK.shape[1]
    if K < 2 or tuple(state_PCW.shape[1:]) != (C, K - 1) or slots_N.shape != (N,) or x_NC.stride(-1) != 1:
        raise ValueError(f"conv_state_step: x [N, C] = {tuple(x_NC.shape)}, state [P, C, K-1] = "
                         f"{tuple(state_PCW.shape)}, slots [N] = {tuple(slots_N.shape)}, w [C, K] = {tuple(w_CK.shape)}")  # fmt: skip
