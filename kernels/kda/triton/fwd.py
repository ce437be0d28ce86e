"""Chunked KDA forward in Triton.

Per chunk of BT = 64 tokens and head, with G the in-chunk cumulative log-decay (stored in log2
units so that every decay is one exp2):

    L   = StrictTril(Diag(beta) (k e^G)(k e^-G)^T)    Aqk = Tril((q e^G)(k e^-G)^T)
    X   = (I + L)^-1                                   W = X Diag(beta) (k e^G),  U = X Diag(beta) v
    Vn  = U - W S                                      O = scale (q e^G) S + scale Aqk Vn
    S'  = Diag(e^G_C) S + (k e^(G_C - G))^T Vn

The products with e^-G are never formed over a whole chunk: they are taken in 16 x 16 sub-tiles.
Off the diagonal the exponents are referred to the boundary between the two sub-tiles, so both
factors are <= 1 for any decay. On the diagonal they are referred to the tile midpoint, so each factor
is at most e^(8 |g_min|); that is where the contract g >= G_MIN (= -5, i.e. <= e^40) is needed, and
it lets the diagonal tiles use the same dense tl.dot as the rest instead of a per-pair loop.
Deviation from the plain dense tile (one bf16 tensor-core product of bf16 operands; FLA feeds fp32
operands, i.e. tf32): by default those sub-tile products are "bf16x3" (operands split into bf16 hi + lo,
three bf16 tensor-core products, about 16 mantissa bits), because L feeds (I + L)^-1: single bf16
rounding there made o and dv errors ~1.5x larger (interpreter, D = 64, vs float64).
LONGHORIZON_KDA_INTRA_PREC=bf16|tf32|bf16x3 selects (common.intra_precision).

Kernels, in launch order:
- `_cumsum`: G, the in-chunk cumulative log-decay (log2 units).
- `_diag`: one program per diagonal 16 x 16 sub-tile (four per chunk, adjacent in launch order): Aqk_ii
  and L_ii, then X_ii = (I + L_ii)^-1 by forward substitution, each row of L read back from memory.
- `_offdiag`: one program per chunk: the six pairs below the diagonal, Aqk_ij and L_ij accumulated
  over feature blocks, then X's blocks below the diagonal by block back-substitution from the X_ii.
- `_wy`: W, U, q e^G and k e^(G_C - G) as whole-chunk 64 x 64 products.
- `_state`: sequential over a sequence's chunks: the per-chunk states and Vn.
- `_output`: O, parallel over chunks and value blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.triton import launch
from kernels.kda.triton.common import (
    BC,
    BT,
    LOG2E,
    ChunkPlan,
    block_size,
    chunk_bounds,
    decay_factor,
    intra_precision,
    load_row,
    load_rows,
    load_tile,
    mma,
    pdot,
    rcumsum,
    row_ptr,
    rsum,
    store_tile,
)


@triton.jit
def _cumsum_kernel(g, G, cu_seqlens, chunk_indices, H, K, BK: tl.constexpr, BT: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    g_BK = load_tile(g + i_h * K, t0, eos, H * K, 0, BT, K, BK)
    store_tile(G + i_h * K, rcumsum(g_BK, 0, False) * 1.4426950408889634, t0, eos, H * K, 0, BT, K, BK)


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_sq(ptr, x, ti, eos, j, H, BT: tl.constexpr, BC: tl.constexpr):
    store_tile(ptr + j * BC, x, ti, eos, H * BT, 0, BC, BC, BC)


@triton.jit
def _store_below(ptr, x10, x20, x21, x30, x31, x32, t0, eos, H, BT: tl.constexpr, BC: tl.constexpr):
    """The six 16 x 16 blocks below the diagonal of a chunk's [BT, BT] matrix."""
    _store_sq(ptr, x10, t0 + BC, eos, 0, H, BT, BC)
    _store_sq(ptr, x20, t0 + 2 * BC, eos, 0, H, BT, BC)
    _store_sq(ptr, x21, t0 + 2 * BC, eos, 1, H, BT, BC)
    _store_sq(ptr, x30, t0 + 3 * BC, eos, 0, H, BT, BC)
    _store_sq(ptr, x31, t0 + 3 * BC, eos, 1, H, BT, BC)
    _store_sq(ptr, x32, t0 + 3 * BC, eos, 2, H, BT, BC)


@triton.jit
def _load_sq(ptr, ti, eos, j, H, BT: tl.constexpr, BC: tl.constexpr):
    return load_tile(ptr + j * BC, ti, eos, H * BT, 0, BC, BC, BC)


@triton.autotune(
    configs=launch.configs("_diag_kernel"),
    key=["H", "K", "PREC"],
    prune_configs_by=launch.prune("_diag_kernel"),
)
@triton.jit
def _diag_kernel(
    q, k, G, beta, Aqk, Ainv, Qg, cu_seqlens, chunk_indices, H, K,
    BK: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Diagonal sub-tile I of a chunk (program axis 0 = chunk * 4 + I): Aqk_II and L_II with the
    exponents referred to the tile midpoint, then X_II = (I + L_II)^-1 by forward substitution whose rows
    of L are read back from global memory (a row load instead of a cross-warp extraction from the
    register tile). Also writes q e^G for the output pass, from the tiles already loaded."""
    i_c, I, i_h = tl.program_id(0) // (BT // BC), tl.program_id(0) % (BT // BC), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    ti = t0 + I * BC
    if ti >= eos:
        return
    q, k, G, beta = q + i_h * K, k + i_h * K, G + i_h * K, beta + i_h
    Aqk, Ainv = Aqk + i_h * BT + I * BC, Ainv + i_h * BT + I * BC
    st = H * K
    q_i = load_tile(q, ti, eos, st, 0, BC, K, BK)
    k_i = load_tile(k, ti, eos, st, 0, BC, K, BK)
    G_i = load_tile(G, ti, eos, st, 0, BC, K, BK)
    store_tile(Qg + i_h * K, q_i * tl.exp2(G_i), ti, eos, st, 0, BC, K, BK)  # for the output pass
    b_i = load_rows(beta, ti, eos, H, BC)
    ref_m = load_row(G, tl.minimum(ti + BC // 2, eos - 1), st, K, BK)
    f_m = decay_factor(G_i, ref_m, ti, eos, BC, 1.0)
    kc_i = k_i * decay_factor(G_i, ref_m, ti, eos, BC, -1.0)
    r = tl.arange(0, BC)
    A = tl.where(r[:, None] >= r[None, :], pdot(q_i * f_m, tl.trans(kc_i), PREC), 0.0)
    store_tile(Aqk, A, ti, eos, H * BT, 0, BC, BC, BC)
    L = tl.where(r[:, None] > r[None, :], pdot(k_i * f_m, tl.trans(kc_i), PREC) * b_i[:, None], 0.0)
    store_tile(Ainv, L, ti, eos, H * BT, 0, BC, BC, BC)
    tl.debug_barrier()
    # rows of Y = X - I: Y_0 = 0, Y_1 = -L_1, Y_i = -L_i - sum_{j<i} L_ij Y_j
    Y = -L
    for i in range(2, tl.minimum(BC, eos - ti)):
        y = -tl.load(row_ptr(Ainv, ti + i, H * BT) + r)
        y = tl.where(r < i, y, 0.0)
        y += rsum(y[:, None] * Y, 0)
        Y = tl.where(r[:, None] == i, y[None, :], Y)
    store_tile(Ainv, Y + tl.where(r[:, None] == r[None, :], 1.0, 0.0), ti, eos, H * BT, 0, BC, BC, BC)


@triton.jit
def _pair(
    qf_i, kf_i, k, G, ref_i, tj, eos, stk, k0, K, BKO: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr
):
    """Pair (i, j < i) over one feature block: (Aqk_ij, L_ij before beta) from row i's decayed q and k
    and column tile j's k decayed to the same reference."""
    kc_j = load_tile(k, tj, eos, stk, k0, BC, K, BKO) * decay_factor(
        load_tile(G, tj, eos, stk, k0, BC, K, BKO), ref_i, tj, eos, BC, -1.0
    )
    kc_t = tl.trans(kc_j)
    return pdot(qf_i, kc_t, PREC), pdot(kf_i, kc_t, PREC)


@triton.jit
def _row_ops(q, k, G, ti, eos, stk, k0, K, BKO: tl.constexpr, BC: tl.constexpr):
    """Row tile i's q and k decayed to the tile's first row (factors <= 1), and that reference."""
    cols = k0 + tl.arange(0, BKO)
    ref = tl.load(row_ptr(G, tl.minimum(ti, eos - 1), stk) + cols, mask=cols < K, other=0.0)
    f = decay_factor(load_tile(G, ti, eos, stk, k0, BC, K, BKO), ref, ti, eos, BC, 1.0)
    return load_tile(q, ti, eos, stk, k0, BC, K, BKO) * f, load_tile(k, ti, eos, stk, k0, BC, K, BKO) * f, ref


@triton.autotune(
    configs=launch.configs("_offdiag_kernel"),
    key=["H", "K", "PREC"],
    prune_configs_by=launch.prune("_offdiag_kernel"),
)
@triton.jit
def _offdiag_kernel(
    q, k, G, beta, Aqk, Ainv, cu_seqlens, chunk_indices, H, K,
    BKO: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The six sub-tile pairs below the diagonal of one chunk: Aqk_ij and L_ij accumulated over feature
    blocks of BKO (exponents referred to the first row of tile i, so every factor is <= 1), then the
    blocks of X = (I + L)^-1 below the diagonal from the X_ii of `_diag_kernel`:
    X_ij = -X_ii sum_{m=j}^{i-1} L_im X_mj."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    q, k, G, beta = q + i_h * K, k + i_h * K, G + i_h * K, beta + i_h
    Aqk, Ainv = Aqk + i_h * BT, Ainv + i_h * BT
    stk = H * K
    t1, t2, t3 = t0 + BC, t0 + 2 * BC, t0 + 3 * BC
    zero = tl.full([BC, BC], 0.0, tl.float32)
    A10, A20, A21, A30, A31, A32 = zero, zero, zero, zero, zero, zero
    L10, L20, L21, L30, L31, L32 = zero, zero, zero, zero, zero, zero
    for k0 in range(0, K, BKO):
        qf, kf, ref = _row_ops(q, k, G, t1, eos, stk, k0, K, BKO, BC)
        a, l = _pair(qf, kf, k, G, ref, t0, eos, stk, k0, K, BKO, BC, PREC)
        A10, L10 = A10 + a, L10 + l
        qf, kf, ref = _row_ops(q, k, G, t2, eos, stk, k0, K, BKO, BC)
        a, l = _pair(qf, kf, k, G, ref, t0, eos, stk, k0, K, BKO, BC, PREC)
        A20, L20 = A20 + a, L20 + l
        a, l = _pair(qf, kf, k, G, ref, t1, eos, stk, k0, K, BKO, BC, PREC)
        A21, L21 = A21 + a, L21 + l
        qf, kf, ref = _row_ops(q, k, G, t3, eos, stk, k0, K, BKO, BC)
        a, l = _pair(qf, kf, k, G, ref, t0, eos, stk, k0, K, BKO, BC, PREC)
        A30, L30 = A30 + a, L30 + l
        a, l = _pair(qf, kf, k, G, ref, t1, eos, stk, k0, K, BKO, BC, PREC)
        A31, L31 = A31 + a, L31 + l
        a, l = _pair(qf, kf, k, G, ref, t2, eos, stk, k0, K, BKO, BC, PREC)
        A32, L32 = A32 + a, L32 + l
    _store_below(Aqk, A10, A20, A21, A30, A31, A32, t0, eos, H, BT, BC)
    b1 = load_rows(beta, t1, eos, H, BC)[:, None]
    b2 = load_rows(beta, t2, eos, H, BC)[:, None]
    b3 = load_rows(beta, t3, eos, H, BC)[:, None]
    L10, L20, L21, L30, L31, L32 = L10 * b1, L20 * b2, L21 * b2, L30 * b3, L31 * b3, L32 * b3
    X00 = _load_sq(Ainv, t0, eos, 0, H, BT, BC)
    X11 = _load_sq(Ainv, t1, eos, 1, H, BT, BC)
    X22 = _load_sq(Ainv, t2, eos, 2, H, BT, BC)
    X33 = _load_sq(Ainv, t3, eos, 3, H, BT, BC)
    X10 = -_mm(X11, _mm(L10, X00))
    X21 = -_mm(X22, _mm(L21, X11))
    X32 = -_mm(X33, _mm(L32, X22))
    X20 = -_mm(X22, _mm(L20, X00) + _mm(L21, X10))
    X31 = -_mm(X33, _mm(L31, X11) + _mm(L32, X21))
    X30 = -_mm(X33, _mm(L30, X00) + _mm(L31, X10) + _mm(L32, X20))
    _store_below(Ainv, X10, X20, X21, X30, X31, X32, t0, eos, H, BT, BC)


@triton.autotune(
    configs=launch.configs("_wy_kernel"), key=["H", "K", "V"], prune_configs_by=launch.prune("_wy_kernel")
)
@triton.jit
def _wy_kernel(
    k, v, G, beta, Ainv, W, U, Kd, cu_seqlens, chunk_indices, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """W = X Diag(beta)(k e^G) and U = X Diag(beta) v as whole-chunk 64 x 64 products, and the decayed
    k e^(G_C - G) the state pass reads."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    DT = W.dtype.element_ty
    stk, stv = H * K, H * V
    r = tl.arange(0, BT)
    # blocks above the diagonal of Ainv are never written: mask them
    X = tl.where(r[:, None] >= r[None, :], load_tile(Ainv + i_h * BT, t0, eos, H * BT, 0, BT, BT, BT), 0.0)
    X = X.to(DT)
    b = load_rows(beta + i_h, t0, eos, H, BT)[:, None]
    v_t = load_tile(v + i_h * V, t0, eos, stv, 0, BT, V, BV)
    store_tile(U + i_h * V, mma(X, (b * v_t).to(DT)), t0, eos, stv, 0, BT, V, BV)
    G_t = load_tile(G + i_h * K, t0, eos, stk, 0, BT, K, BK)
    k_t = load_tile(k + i_h * K, t0, eos, stk, 0, BT, K, BK)
    store_tile(W + i_h * K, mma(X, (b * k_t * tl.exp2(G_t)).to(DT)), t0, eos, stk, 0, BT, K, BK)
    g_last = load_row(G + i_h * K, tl.minimum(t0 + BT, eos) - 1, stk, K, BK)
    store_tile(Kd + i_h * K, k_t * decay_factor(G_t, g_last, t0, eos, BT, -1.0), t0, eos, stk, 0, BT, K, BK)


@triton.autotune(
    configs=launch.configs("_state_kernel"),
    key=["H", "K", "V"],
    prune_configs_by=launch.prune("_state_kernel"),
)
@triton.jit
def _state_kernel(
    Kd, G, W, U, h0, Hc, Vn, ht, cu_seqlens, chunk_offsets, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
):  # fmt: skip
    """Sequential pass over one sequence's chunks for one head and BV value columns."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    DT = W.dtype.element_ty
    Kd, G, W, U, Vn = Kd + i_h * K, G + i_h * K, W + i_h * K, U + i_h * V, Vn + i_h * V
    v0 = i_v * BV
    rk, rv = tl.arange(0, BK), v0 + tl.arange(0, BV)
    kv_mask = (rk[:, None] < K) & (rv[None, :] < V)
    kv_off = rk[:, None] * V + rv[None, :]
    h = tl.full([BK, BV], 0.0, tl.float32)
    if HAS_H0:
        h += tl.load(h0 + i_nh * K * V + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    for c in range(0, (eos - bos + BT - 1) // BT):
        t0 = bos + c * BT
        tl.store(Hc + ((c0 + c) * H + i_h) * K * V + kv_off, h.to(DT), mask=kv_mask)
        w = load_tile(W, t0, eos, H * K, 0, BT, K, BK).to(DT)
        vn = load_tile(U, t0, eos, H * V, v0, BT, V, BV) - mma(w, h.to(DT))
        store_tile(Vn, vn, t0, eos, H * V, v0, BT, V, BV)
        g_last = load_row(G, tl.minimum(t0 + BT, eos) - 1, H * K, K, BK)
        kd = load_tile(Kd, t0, eos, H * K, 0, BT, K, BK).to(DT)
        h = h * tl.exp2(g_last)[:, None] + mma(tl.trans(kd), vn.to(DT))
    if STORE_HT:
        tl.store(ht + i_nh * K * V + kv_off, h, mask=kv_mask)


@triton.autotune(
    configs=launch.configs("_output_kernel"),
    key=["H", "K", "V"],
    prune_configs_by=launch.prune("_output_kernel"),
)
@triton.jit
def _output_kernel(
    Qg, Hc, Aqk, Vn, o, scale, cu_seqlens, chunk_indices, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    NV = (V + BV - 1) // BV  # axis 0 = chunk * NV + value block: no 65535 limit on the chunk count
    i_v, i_c, i_h = tl.program_id(0) % NV, tl.program_id(0) // NV, tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    DT = Vn.dtype.element_ty
    v0 = i_v * BV
    qg = load_tile(Qg + i_h * K, t0, eos, H * K, 0, BT, K, BK)
    rk, rv = tl.arange(0, BK), v0 + tl.arange(0, BV)
    kv_mask = (rk[:, None] < K) & (rv[None, :] < V)
    h = tl.load(
        Hc + (i_c.to(tl.int64) * H + i_h) * K * V + rk[:, None] * V + rv[None, :], mask=kv_mask, other=0.0
    )
    r = tl.arange(0, BT)
    A = load_tile(Aqk + i_h * BT, t0, eos, H * BT, 0, BT, BT, BT)
    A = tl.where(r[:, None] >= r[None, :], A, 0.0)
    vn = load_tile(Vn + i_h * V, t0, eos, H * V, v0, BT, V, BV)
    out = mma(qg.to(DT), h.to(DT)) + mma(A.to(DT), vn.to(DT))
    store_tile(o + i_h * V, out * scale, t0, eos, H * V, v0, BT, V, BV)


def kda_fwd(q, k, v, g, beta, scale: float, h0, plan: ChunkPlan, store_ht: bool):
    """q, k, g [T, H, K], v [T, H, V], beta [T, H] (tokens flattened). Returns a dict of tensors."""
    T, H, K = q.shape
    V = v.shape[-1]
    NC, N = plan.num_chunks, plan.num_seqs
    BK, BV = block_size(K), block_size(V)
    dt = q.dtype
    dev = q.device
    G = torch.empty(T, H, K, device=dev, dtype=torch.float32)
    Aqk = torch.empty(T, H, BT, device=dev, dtype=dt)
    Ainv = torch.empty(T, H, BT, device=dev, dtype=torch.float32)  # fp32: dL = -X^T dX X^T in the backward
    W, U = torch.empty(T, H, K, device=dev, dtype=dt), torch.empty(T, H, V, device=dev, dtype=dt)
    Qg, Kd = torch.empty(T, H, K, device=dev, dtype=dt), torch.empty(T, H, K, device=dev, dtype=dt)
    Hc = torch.empty(NC, H, K, V, device=dev, dtype=dt)
    Vn = torch.empty(T, H, V, device=dev, dtype=dt)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if store_ht else G.new_empty(1)
    o = torch.empty(T, H, V, device=dev, dtype=dt)
    cu, ci = plan.cu_seqlens_N1, plan.chunk_indices_C2
    if NC > 0:
        _cumsum_kernel[(NC, H)](g, G, cu, ci, H, K, BK=BK, BT=BT)
        prec = intra_precision(dt)
        _diag_kernel[(NC * (BT // BC), H)](
            q, k, G, beta, Aqk, Ainv, Qg, cu, ci, H, K, BK=BK, BT=BT, BC=BC, PREC=prec
        )
        _offdiag_kernel[(NC, H)](q, k, G, beta, Aqk, Ainv, cu, ci, H, K, BT=BT, BC=BC, PREC=prec)
        _wy_kernel[(NC, H)](k, v, G, beta, Ainv, W, U, Kd, cu, ci, H, K, V, BK=BK, BV=BV, BT=BT)
    h0_arg = h0 if h0 is not None else G.new_empty(1)
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * H)
    _state_kernel[grid](
        Kd, G, W, U, h0_arg, Hc, Vn, ht, cu, plan.chunk_offsets_N1, H, K, V,
        BK=BK, BT=BT, HAS_H0=h0 is not None, STORE_HT=store_ht,
    )  # fmt: skip
    if NC > 0:
        grid_o = lambda meta: (triton.cdiv(V, meta["BV"]) * NC, H)
        _output_kernel[grid_o](Qg, Hc, Aqk, Vn, o, scale, cu, ci, H, K, V, BK=BK, BT=BT)
    return {
        "o": o,
        "ht": ht if store_ht else None,
        "G": G,
        "Aqk": Aqk,
        "Ainv": Ainv,
        "W": W,
        "Hc": Hc,
        "Vn": Vn,
        "Qg": Qg,
        "Kd": Kd,
    }


__all__ = ["LOG2E", "kda_fwd"]
