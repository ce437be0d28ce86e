"""``kernels.attnres.attn_res_mix_norm_triton``'s kernel: one program per token row."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# tl.sum is an @jit function of triton.language.standard, which the interpreter runs only if TRITON_INTERPRET was
# set before triton was imported: tl.reduce with its combine function instead (as kernels/conv/triton.py does)
_sum_combine = tl.standard._sum_combine


@triton.jit
def _mix_norm_row(v_ptr, q_ptr, kw_ptr, ow_ptr, y_ptr, S, D, sv_s, sv_n, sy_n, eps, out_eps,
                  BD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    dm = d < D
    q = tl.load(q_ptr + d, mask=dm, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + d, mask=dm, other=0.0).to(tl.float32)
    m = tl.full([], -float("inf"), tl.float32)
    den = tl.full([], 0.0, tl.float32)
    acc = tl.full([BD], 0.0, tl.float32)
    for s in range(0, S):
        v = tl.load(v_ptr + s * sv_s + row * sv_n + d, mask=dm, other=0.0).to(tl.float32)
        key = v * (1.0 / tl.sqrt(tl.reduce(v * v, 0, _sum_combine) / D + eps)) * kw
        logit = tl.reduce(key * q, 0, _sum_combine)
        m_new = tl.maximum(m, logit)
        scale = tl.exp(m - m_new)  # the softmax over the sources, online: earlier terms rescaled
        p = tl.exp(logit - m_new)
        acc = acc * scale + p * v
        den = den * scale + p
        m = m_new
    h = (acc / den).to(y_ptr.dtype.element_ty).to(tl.float32)  # the mix in the sources' dtype, as the reference
    ow = tl.load(ow_ptr + d, mask=dm, other=0.0).to(tl.float32)
    y = h * (1.0 / tl.sqrt(tl.reduce(h * h, 0, _sum_combine) / D + out_eps)) * ow
    tl.store(y_ptr + row * sy_n + d, y.to(y_ptr.dtype.element_ty), mask=dm)


def mix_norm_rows(
    query: torch.Tensor, key_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    v_SND: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """y [..., D] in the sources' dtype from v [S, ..., D] (S >= 1, last dim contiguous)."""
    S, D = v_SND.shape[0], v_SND.shape[-1]
    if S < 1 or any(t.shape != (D,) for t in (query, key_weight, out_weight)):
        raise ValueError(f"attn_res_mix_norm: sources [S >= 1, ..., D] and weights [D], got {tuple(v_SND.shape)} and "
                         f"{[tuple(t.shape) for t in (query, key_weight, out_weight)]}")  # fmt: skip
    v = v_SND.reshape(S, -1, D)
    if v.stride(-1) != 1:
        v = v.contiguous()
    N = v.shape[1]
    y = torch.empty(N, D, device=v.device, dtype=v.dtype)
    if N:
        _mix_norm_row[(N,)](v, query, key_weight, out_weight, y, S, D, v.stride(0), v.stride(1), y.stride(0),
                            float(eps), float(out_eps), BD=triton.next_power_of_2(D), num_warps=4)  # fmt: skip
    return y.view(v_SND.shape[1:])


# ------------------------------------------------------------------------------------------ the learner's node
# The learner's mix + norm (``model.attnres._MixNormNode``) reads its sources as they are, unstacked (a stacked
# copy would be one more [S, T, D] tensor a mix): up to MAX_SOURCES pointers, the unused ones repeating the first.
# Each program holds a row of every source as one [SP, BD] fp32 tile (SP = S rounded up to a power of two), so
# every source row is read once per kernel.
MAX_SOURCES = 8


@triton.jit
def _source(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    p = p0
    if i == 1:
        p = p1
    if i == 2:
        p = p2
    if i == 3:
        p = p3
    if i == 4:
        p = p4
    if i == 5:
        p = p5
    if i == 6:
        p = p6
    if i == 7:
        p = p7
    return p


@triton.jit
def _row(i: tl.constexpr, row, d, dm, D, p0, p1, p2, p3, p4, p5, p6, p7):
    """Source ``i``'s row ``row`` as [BD] fp32 (zero past D)."""
    return tl.load(_source(i, p0, p1, p2, p3, p4, p5, p6, p7) + row * D + d, mask=dm, other=0.0).to(tl.float32)


@triton.jit
def _node_weights(q_ptr, kw_ptr, ow_ptr, d, dm):
    """(u = query * key-norm weight, the out-norm weight) as [BD] fp32."""
    u = tl.load(q_ptr + d, mask=dm, other=0.0).to(tl.float32) * tl.load(kw_ptr + d, mask=dm, other=0.0).to(tl.float32)
    return u, tl.load(ow_ptr + d, mask=dm, other=0.0).to(tl.float32)


@triton.jit
def _mix_grad(m, dh_ptr, row, d, dm, go, D, out_eps):
    """(rho, dh, dmix) of one row: the out norm's rsqrt, the output gradient and the mix's gradient through the
    norm, from the fp32 mix m."""
    rho = 1.0 / tl.sqrt(tl.reduce(m * m, 0, _sum_combine) / D + out_eps)
    dh = tl.load(dh_ptr + row * D + d, mask=dm, other=0.0).to(tl.float32)
    yg = dh * go
    return rho, dh, rho * (yg - m * (rho * rho) * (tl.reduce(m * yg, 0, _sum_combine) / D))


@triton.jit
def _put_grad(ptr, dv, mask, ACC: tl.constexpr, i: tl.constexpr):
    """Source ``i``'s gradient ``dv`` (fp32) stored at ``ptr`` in the buffer's dtype; where bit i of ``ACC`` is set,
    added to what the buffer holds (``mix_norm_grads``' ``into``)."""
    if (ACC >> i) & 1:
        dv += tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, dv.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_tile(row, d, dm, u, eps, D, p0, p1, p2, p3, p4, p5, p6, p7, S: tl.constexpr, SP: tl.constexpr,
              BD: tl.constexpr):  # fmt: skip
    """(v [SP, BD], r [SP], vu [SP], a [SP], m [BD]) of one row: the sources, their keys' rsqrt(mean v^2 + eps),
    <v, u>, the softmax weights over the sources and the mix in fp32 (rows s >= S of the tile are zero, a = 0)."""
    sidx = tl.arange(0, SP)
    v = tl.full([SP, BD], 0.0, tl.float32)
    for i in tl.static_range(S):
        v = tl.where(sidx[:, None] == i, _row(i, row, d, dm, D, p0, p1, p2, p3, p4, p5, p6, p7)[None, :], v)
    r = 1.0 / tl.sqrt(tl.reduce(v * v, 1, _sum_combine) / D + eps)
    vu = tl.reduce(v * u[None, :], 1, _sum_combine)
    logit = tl.where(sidx < S, r * vu, -float("inf"))
    e = tl.exp(logit - tl.reduce(logit, 0, tl.standard._elementwise_max))
    a = e / tl.reduce(e, 0, _sum_combine)
    m = tl.reduce(a[:, None] * v, 0, _sum_combine)
    return v, r, vu, a, m


@triton.jit
def _mix_norm_fwd(y_ptr, q_ptr, kw_ptr, ow_ptr, N, D, eps, out_eps, p0, p1, p2, p3, p4, p5, p6, p7,
                  S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    dm = d < D
    u, ow = _node_weights(q_ptr, kw_ptr, ow_ptr, d, dm)
    _v, _r, _vu, _a, m = _mix_tile(row, d, dm, u, eps, D, p0, p1, p2, p3, p4, p5, p6, p7, S, SP, BD)
    h = m.to(y_ptr.dtype.element_ty).to(tl.float32)  # the mix in the sources' dtype, as the reference rounds it
    y = h * (1.0 / tl.sqrt(tl.reduce(h * h, 0, _sum_combine) / D + out_eps)) * ow
    tl.store(y_ptr + row * D + d, y.to(y_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _mix_norm_bwd(dh_ptr, q_ptr, kw_ptr, ow_ptr, du_ptr, dgo_ptr, N, D, eps, out_eps,
                  p0, p1, p2, p3, p4, p5, p6, p7, g0, g1, g2, g3, g4, g5, g6, g7,
                  S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``model.attnres.attn_res_mix_norm_grads`` row by row (its docstring has the formulas): each program walks
    rows pid, pid + P, ... writing every source's gradient (g_i, the sources' dtype) and summing the weights'
    per-row terms du and dg_o over its rows into one [D] partial each (fp32, summed over programs by the caller)."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    d = tl.arange(0, BD)
    dm = d < D
    sidx = tl.arange(0, SP)
    u, go = _node_weights(q_ptr, kw_ptr, ow_ptr, d, dm)
    du = tl.full([BD], 0.0, tl.float32)
    dgo = tl.full([BD], 0.0, tl.float32)
    for row in range(pid.to(tl.int64), N, P):  # int64 rows: row * D stays exact past 2^31 elements
        v, r, vu, a, m = _mix_tile(row, d, dm, u, eps, D, p0, p1, p2, p3, p4, p5, p6, p7, S, SP, BD)
        rho, dh, dmix = _mix_grad(m, dh_ptr, row, d, dm, go, D, out_eps)
        da = tl.reduce(dmix[None, :] * v, 1, _sum_combine)
        ds = a * (da - tl.reduce(a * da, 0, _sum_combine))
        dv = a[:, None] * dmix[None, :] + ds[:, None] * (r[:, None] * u[None, :] - (r * r * r * vu / D)[:, None] * v)
        for i in tl.static_range(S):
            gi = _source(i, g0, g1, g2, g3, g4, g5, g6, g7)
            dvi = tl.reduce(tl.where(sidx[:, None] == i, dv, 0.0), 0, _sum_combine)
            _put_grad(gi + row * D + d, dvi, dm, ACC, i)
        du += tl.reduce((ds * r)[:, None] * v, 0, _sum_combine)
        dgo += dh * m * rho
    tl.store(du_ptr + pid * D + d, du, mask=dm)
    tl.store(dgo_ptr + pid * D + d, dgo, mask=dm)


@triton.jit
def _pick(x, sidx, i: tl.constexpr):
    """Element ``i`` of the [SP] vector ``x`` as a scalar."""
    return tl.reduce(tl.where(sidx == i, x, 0.0), 0, _sum_combine)


@triton.jit
def _mix_norm_bwd_passes(dh_ptr, q_ptr, kw_ptr, ow_ptr, du_ptr, dgo_ptr, N, D, eps, out_eps,
                         p0, p1, p2, p3, p4, p5, p6, p7, g0, g1, g2, g3, g4, g5, g6, g7,
                         S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``_mix_norm_bwd`` with no [SP, BD] tile: each row's sources are walked four times as [BD] vectors (the
    per-source scalars r and <v, u>, then the mix, then <dmix, v>, then each source's gradient), the per-source
    scalars kept in [SP] vectors. A source row is read from memory once and from cache three times more; a program
    holds a few [BD] vectors where the tile version holds several [SP, BD] ones (fewer registers, no masked
    reductions over the tile to split it back into rows)."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    d = tl.arange(0, BD)
    dm = d < D
    sidx = tl.arange(0, SP)
    u, go = _node_weights(q_ptr, kw_ptr, ow_ptr, d, dm)
    du = tl.full([BD], 0.0, tl.float32)
    dgo = tl.full([BD], 0.0, tl.float32)
    for row in range(pid.to(tl.int64), N, P):  # int64 rows: row * D stays exact past 2^31 elements
        r = tl.full([SP], 0.0, tl.float32)
        vu = tl.full([SP], 0.0, tl.float32)
        for i in tl.static_range(S):
            vi = _row(i, row, d, dm, D, p0, p1, p2, p3, p4, p5, p6, p7)
            r = tl.where(sidx == i, 1.0 / tl.sqrt(tl.reduce(vi * vi, 0, _sum_combine) / D + eps), r)
            vu = tl.where(sidx == i, tl.reduce(vi * u, 0, _sum_combine), vu)
        logit = tl.where(sidx < S, r * vu, -float("inf"))
        e = tl.exp(logit - tl.reduce(logit, 0, tl.standard._elementwise_max))
        a = e / tl.reduce(e, 0, _sum_combine)
        m = tl.full([BD], 0.0, tl.float32)
        for i in tl.static_range(S):
            vi = _row(i, row, d, dm, D, p0, p1, p2, p3, p4, p5, p6, p7)
            m += _pick(a, sidx, i) * vi
        rho, dh, dmix = _mix_grad(m, dh_ptr, row, d, dm, go, D, out_eps)
        da = tl.full([SP], 0.0, tl.float32)
        for i in tl.static_range(S):
            vi = _row(i, row, d, dm, D, p0, p1, p2, p3, p4, p5, p6, p7)
            da = tl.where(sidx == i, tl.reduce(dmix * vi, 0, _sum_combine), da)
        ds = a * (da - tl.reduce(a * da, 0, _sum_combine))
        for i in tl.static_range(S):
            vi = _row(i, row, d, dm, D, p0, p1, p2, p3, p4, p5, p6, p7)
            ri, dsi = _pick(r, sidx, i), _pick(ds, sidx, i)
            dvi = _pick(a, sidx, i) * dmix + dsi * (ri * u - (ri * ri * ri * _pick(vu, sidx, i) / D) * vi)
            gi = _source(i, g0, g1, g2, g3, g4, g5, g6, g7)
            _put_grad(gi + row * D + d, dvi, dm, ACC, i)
            du += (dsi * ri) * vi
        dgo += dh * m * rho
    tl.store(du_ptr + pid * D + d, du, mask=dm)
    tl.store(dgo_ptr + pid * D + d, dgo, mask=dm)


@triton.jit
def _rows(i: tl.constexpr, rows, m2, d, D, p0, p1, p2, p3, p4, p5, p6, p7):
    """Source ``i``'s rows ``rows`` [BR] as [BR, BD] fp32 (zero where ``m2`` is False)."""
    ptr = _source(i, p0, p1, p2, p3, p4, p5, p6, p7) + rows[:, None] * D + d[None, :]
    return tl.load(ptr, mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _col(x, sidx, i: tl.constexpr):
    """Column ``i`` of the [BR, SP] tensor ``x`` as [BR]."""
    return tl.reduce(tl.where(sidx[None, :] == i, x, 0.0), 1, _sum_combine)


@triton.jit
def _mix_norm_bwd_rows(dh_ptr, q_ptr, kw_ptr, ow_ptr, du_ptr, dgo_ptr, N, D, eps, out_eps,
                       p0, p1, p2, p3, p4, p5, p6, p7, g0, g1, g2, g3, g4, g5, g6, g7,
                       S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                       ACC: tl.constexpr):  # fmt: skip
    """``_mix_norm_bwd_passes`` on BR rows at a time: each source walked four times as a [BR, BD] tile, the per-row
    per-source scalars in [BR, SP] tiles, so that a row's sums over D stay inside the warps that hold it (the row
    kernels' sums over D cross every warp of the program) and a program has BR rows' loads in flight at once;
    the weights' per-row terms summed over the program's rows in [BR, BD] accumulators, reduced once at the end."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    d = tl.arange(0, BD)
    dm = d < D
    sidx = tl.arange(0, SP)
    u, go = _node_weights(q_ptr, kw_ptr, ow_ptr, d, dm)
    du = tl.full([BR, BD], 0.0, tl.float32)
    dgo = tl.full([BR, BD], 0.0, tl.float32)
    for blk in range(pid.to(tl.int64), (N + BR - 1) // BR, P):  # int64 rows: row * D stays exact past 2^31 elements
        rows = blk * BR + tl.arange(0, BR)
        m2 = (rows < N)[:, None] & dm[None, :]
        r = tl.full([BR, SP], 0.0, tl.float32)
        vu = tl.full([BR, SP], 0.0, tl.float32)
        for i in tl.static_range(S):
            vi = _rows(i, rows, m2, d, D, p0, p1, p2, p3, p4, p5, p6, p7)
            ri = 1.0 / tl.sqrt(tl.reduce(vi * vi, 1, _sum_combine) / D + eps)
            r = tl.where(sidx[None, :] == i, ri[:, None], r)
            vu = tl.where(sidx[None, :] == i, tl.reduce(vi * u[None, :], 1, _sum_combine)[:, None], vu)
        logit = tl.where(sidx[None, :] < S, r * vu, -float("inf"))
        e = tl.exp(logit - tl.reduce(logit, 1, tl.standard._elementwise_max)[:, None])
        a = e / tl.reduce(e, 1, _sum_combine)[:, None]
        m = tl.full([BR, BD], 0.0, tl.float32)
        for i in tl.static_range(S):
            m += _col(a, sidx, i)[:, None] * _rows(i, rows, m2, d, D, p0, p1, p2, p3, p4, p5, p6, p7)
        rho = 1.0 / tl.sqrt(tl.reduce(m * m, 1, _sum_combine) / D + out_eps)  # the out norm's, per row
        dh = tl.load(dh_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        yg = dh * go[None, :]
        dmix = rho[:, None] * (yg - m * (rho * rho)[:, None] * (tl.reduce(m * yg, 1, _sum_combine) / D)[:, None])
        da = tl.full([BR, SP], 0.0, tl.float32)
        for i in tl.static_range(S):
            vi = _rows(i, rows, m2, d, D, p0, p1, p2, p3, p4, p5, p6, p7)
            da = tl.where(sidx[None, :] == i, tl.reduce(dmix * vi, 1, _sum_combine)[:, None], da)
        ds = a * (da - tl.reduce(a * da, 1, _sum_combine)[:, None])
        for i in tl.static_range(S):
            vi = _rows(i, rows, m2, d, D, p0, p1, p2, p3, p4, p5, p6, p7)
            ri, dsi = _col(r, sidx, i), _col(ds, sidx, i)
            dvi = _col(a, sidx, i)[:, None] * dmix + dsi[:, None] * (
                ri[:, None] * u[None, :] - (ri * ri * ri * _col(vu, sidx, i) / D)[:, None] * vi
            )
            gi = _source(i, g0, g1, g2, g3, g4, g5, g6, g7)
            _put_grad(gi + rows[:, None] * D + d[None, :], dvi, m2, ACC, i)
            du += (dsi * ri)[:, None] * vi
        dgo += dh * m * rho[:, None]
    tl.store(du_ptr + pid * D + d, tl.reduce(du, 0, _sum_combine), mask=dm)
    tl.store(dgo_ptr + pid * D + d, tl.reduce(dgo, 0, _sum_combine), mask=dm)


BACKWARD_KERNELS = {
    "tile": (_mix_norm_bwd, 4, {}),
    "passes": (_mix_norm_bwd_passes, 4, {}),
    "rows": (_mix_norm_bwd_rows, 8, {"BR": 4}),
}
"""``mix_norm_grads``' kernels, their warps and their other compile-time arguments: "tile" (the default, measured
in the learner's step on GPUs) holds a row's sources as one [SP, BD] tile; "passes" walks them as [BD] vectors
(``model.fast`` op attn_res = triton_passes: the A/B); "rows" walks them as [BR, BD] tiles of BR rows (the launch
sweep's candidate, ``bench/learner_kernels.py``)."""
PROGRAMS_PER_SM = 8
"""The backward's programs (each walks rows pid, pid + P, ...) per streaming multiprocessor. 8 programs of 4 warps
took the gpu_1b step's mixes from 11.7 to 8.7 ms on an H100 against 4 of 8 (``bench/learner_kernels.py``,
bench/RESULTS.md 2026-12-06): the tile's fp32 registers cap how many programs a multiprocessor holds."""


def _rows_of(sources, weights) -> tuple[list[torch.Tensor], int, int]:
    """The sources as contiguous [N, D] rows (views where they already are), N and D; bad shapes named. The
    sources may differ in dtype (under autocast a block's running sum starts as a bf16 sub-layer output beside
    fp32 sums): each is read in its own and the mix takes their promoted dtype, as ``torch.stack`` does."""
    S, D = len(sources), sources[0].shape[-1]
    shape = sources[0].shape
    if not 1 <= S <= MAX_SOURCES or any(t.shape != shape for t in sources) or any(w.shape != (D,) for w in weights):
        raise ValueError(f"attn_res_mix_norm: 1 to {MAX_SOURCES} sources of one shape [..., D] and weights [D], got "
                         f"{[tuple(t.shape) for t in sources]} and {[tuple(w.shape) for w in weights]}")  # fmt: skip
    rows = [t.reshape(-1, D).contiguous() for t in sources]
    return rows, rows[0].shape[0], D


def _grad_buffers(rows, sources, into) -> tuple[list[torch.Tensor], int]:
    """The sources' gradient buffers as [N, D] rows (``into``'s where given, else new) and the bit mask of those to
    add to; a bad buffer named."""
    into = [None] * len(rows) if into is None else list(into)
    if len(into) != len(rows):
        raise ValueError(f"attn_res_mix_norm: into needs one entry per source ({len(rows)}), got {len(into)}")
    grads, acc = [], 0
    for i, (r, src, buf) in enumerate(zip(rows, sources, into)):
        if buf is None:
            grads.append(torch.empty_like(r))
            continue
        if buf.shape != src.shape or buf.dtype != src.dtype or buf.device != src.device or not buf.is_contiguous():
            raise ValueError(f"attn_res_mix_norm: into[{i}] must be contiguous {tuple(src.shape)} {src.dtype} on "
                             f"{src.device} like its source, got {tuple(buf.shape)} {buf.dtype} on {buf.device}")  # fmt: skip
        grads.append(buf.view(r.shape))
        acc |= 1 << i
    return grads, acc


def _padded(ptrs: list[torch.Tensor]) -> list[torch.Tensor]:
    return ptrs + [ptrs[0]] * (MAX_SOURCES - len(ptrs))


def mix_norm_forward(
    query: torch.Tensor, key_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    *sources: torch.Tensor, warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """``model.attnres.attn_res_mix_norm`` over unstacked sources: y [..., D] in the sources' dtype, one program
    of ``warps`` warps a row."""
    rows, N, D = _rows_of(sources, (query, key_weight, out_weight))
    y = torch.empty(N, D, device=rows[0].device, dtype=functools.reduce(torch.promote_types, [t.dtype for t in rows]))
    if N:
        S = len(rows)
        _mix_norm_fwd[(N,)](y, query, key_weight, out_weight, N, D, float(eps), float(out_eps), *_padded(rows),
                            S=S, SP=triton.next_power_of_2(S), BD=triton.next_power_of_2(D), num_warps=warps)  # fmt: skip
    return y.view(sources[0].shape)


def mix_norm_grads(
    query: torch.Tensor, key_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    dh: torch.Tensor, *sources: torch.Tensor, programs: int | None = None, kernel: str = "tile",
    warps: int | None = None, into: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``model.attnres.attn_res_mix_norm_grads``: (d query, d key_weight, d out_weight, *d sources), each in its
    input's dtype. ``programs``: how many programs share the rows (default: ``PROGRAMS_PER_SM`` per streaming
    multiprocessor on CUDA, 4 elsewhere); each adds one [D] fp32 partial of the weights' sums. ``kernel``: a key of
    ``BACKWARD_KERNELS``; ``warps``: its warps (default: the kernel's). ``into``: per source a contiguous buffer of
    its shape and dtype that its gradient is added to in place (in fp32, rounded once) and returned as it, or None
    for a new one (``model.attnres.SharedSourceGrads``: no separate pass to sum a source's gradients)."""
    if kernel not in BACKWARD_KERNELS:
        raise ValueError(f"attn_res_mix_norm: backward kernel {kernel!r}; choose from {sorted(BACKWARD_KERNELS)}")
    rows, N, D = _rows_of(sources, (query, key_weight, out_weight))
    if dh.shape != sources[0].shape:
        raise ValueError(f"attn_res_mix_norm: the output gradient must be {tuple(sources[0].shape)}, got "
                         f"{tuple(dh.shape)}")  # fmt: skip
    dev = rows[0].device
    grads, acc = _grad_buffers(rows, sources, into)
    if programs is None:
        programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    P = max(1, min(programs, N))
    du = torch.zeros(P, D, device=dev, dtype=torch.float32)
    dgo = torch.zeros(P, D, device=dev, dtype=torch.float32)
    if N:
        S = len(rows)
        fn, default_warps, constants = BACKWARD_KERNELS[kernel]
        fn[(P,)](dh.reshape(N, D).contiguous(), query, key_weight, out_weight, du, dgo, N, D, float(eps),
                 float(out_eps), *_padded(rows), *_padded(grads), S=S, SP=triton.next_power_of_2(S),
                 BD=triton.next_power_of_2(D), ACC=acc, num_warps=warps or default_warps, **constants)  # fmt: skip
    du, dgo = du.sum(0), dgo.sum(0)
    shape = sources[0].shape
    return ((du * key_weight.float()).to(query.dtype), (du * query.float()).to(key_weight.dtype),
            dgo.to(out_weight.dtype), *(g.view(shape) for g in grads))  # fmt: skip
