"""Chunked KDA backward in Triton (notation of fwd.py; dX means the gradient of the loss wrt X).

Reverse pass over chunks (`_state_bwd`), with dS' the gradient of the state leaving a chunk:

    dVn = scale Aqk^T dO + (k e^(G_C - G)) dS'
    dS  = Diag(e^G_C) dS' + scale (q e^G)^T dO - W^T dVn

Per chunk (`_main_bwd`, parallel): the inter-chunk terms of dq, dk, the WY terms
(dW = -dVn S^T, dU = dVn, through X = (I + L)^-1: dL = -X^T (dW Xk^T + dU Yv^T) X^T) and their
contributions to dbeta, dv and to dG, the gradient wrt the cumulative log-decay. `_intra_bwd` (one
program per 16-row sub-tile and feature block, a chunk's programs adjacent in launch order) adds the
terms of Aqk and L, again in 16 x 16 sub-tiles with the reference exponents of the forward; `_dg` turns
dG into dg by a reverse cumulative sum within the chunk (e^(G_C), the chunk's total decay, feeds every
position of the chunk: the carry that sum starts from) and sums dbeta's per-feature-block partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.triton import launch
from kernels.kda.triton.common import (
    BC,
    BT,
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


@triton.autotune(
    configs=launch.configs("_dav_kernel"), key=["H", "V"], prune_configs_by=launch.prune("_dav_kernel")
)
@triton.jit
def _dav_kernel(
    Aqk, Vn, do, dAqk, dVi, scale, cu_seqlens, chunk_indices, H, V, BV: tl.constexpr, BT: tl.constexpr
):
    """dAqk = scale Tril(dO Vn^T) and the intra-chunk part of dVn, scale Aqk^T dO."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    DT = Vn.dtype.element_ty
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]
    A = tl.where(causal, load_tile(Aqk + i_h * BT, t0, eos, H * BT, 0, BT, BT, BT), 0.0).to(DT)
    dA = tl.full([BT, BT], 0.0, tl.float32)
    for v0 in range(0, V, BV):
        do_t = load_tile(do + i_h * V, t0, eos, H * V, v0, BT, V, BV).to(DT)
        vn = load_tile(Vn + i_h * V, t0, eos, H * V, v0, BT, V, BV).to(DT)
        dA += mma(do_t, tl.trans(vn))
        store_tile(dVi + i_h * V, mma(tl.trans(A), do_t) * scale, t0, eos, H * V, v0, BT, V, BV)
    store_tile(dAqk + i_h * BT, tl.where(causal, dA * scale, 0.0), t0, eos, H * BT, 0, BT, BT, BT)


@triton.autotune(
    configs=launch.configs("_state_bwd_kernel"),
    key=["H", "K", "V"],
    prune_configs_by=launch.prune("_state_bwd_kernel"),
)
@triton.jit
def _state_bwd_kernel(
    Qg, Kd, G, W, do, dVi, dht, dHc, dVn, dh0, scale, cu_seqlens, chunk_offsets, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    DT = W.dtype.element_ty
    Qg, Kd, G, W = Qg + i_h * K, Kd + i_h * K, G + i_h * K, W + i_h * K
    do, dVi, dVn = do + i_h * V, dVi + i_h * V, dVn + i_h * V
    v0 = i_v * BV
    rk, rv = tl.arange(0, BK), v0 + tl.arange(0, BV)
    kv_mask = (rk[:, None] < K) & (rv[None, :] < V)
    kv_off = rk[:, None] * V + rv[None, :]
    dh = tl.full([BK, BV], 0.0, tl.float32)
    if HAS_DHT:
        dh += tl.load(dht + i_nh * K * V + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    n_chunks = (eos - bos + BT - 1) // BT
    for cc in range(0, n_chunks):
        c = n_chunks - 1 - cc
        t0 = bos + c * BT
        tl.store(dHc + ((c0 + c) * H + i_h) * K * V + kv_off, dh.to(DT), mask=kv_mask)
        g_last = load_row(G, tl.minimum(t0 + BT, eos) - 1, H * K, K, BK)
        kd = load_tile(Kd, t0, eos, H * K, 0, BT, K, BK).to(DT)
        dvn = load_tile(dVi, t0, eos, H * V, v0, BT, V, BV) + mma(kd, dh.to(DT))
        store_tile(dVn, dvn, t0, eos, H * V, v0, BT, V, BV)
        qg = load_tile(Qg, t0, eos, H * K, 0, BT, K, BK)
        do_t = load_tile(do, t0, eos, H * V, v0, BT, V, BV).to(DT)
        w = load_tile(W, t0, eos, H * K, 0, BT, K, BK).to(DT)
        dh = dh * tl.exp2(g_last)[:, None] + scale * mma(tl.trans(qg.to(DT)), do_t)
        dh -= mma(tl.trans(w), dvn.to(DT))
    if STORE_DH0:
        tl.store(dh0 + i_nh * K * V + kv_off, dh, mask=kv_mask)


@triton.jit
def _kv_tile(ptr, i_c, i_h, H, K, V, k0, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Rows k0..k0+BK, columns v0..v0+BV of chunk i_c's [K, V] state tile for head i_h."""
    rk, rv = k0 + tl.arange(0, BK), v0 + tl.arange(0, BV)
    mask = (rk[:, None] < K) & (rv[None, :] < V)
    return tl.load(
        ptr + (i_c.to(tl.int64) * H + i_h) * K * V + rk[:, None] * V + rv[None, :], mask=mask, other=0.0
    )


@triton.autotune(
    configs=launch.configs("_main_bwd_kernel"),
    key=["H", "K", "V", "PREC"],
    prune_configs_by=launch.prune("_main_bwd_kernel"),
)
@triton.jit
def _main_bwd_kernel(
    q, k, v, G, beta, Ainv, Hc, dHc, Vn, dVn, do, dq, dk, dG, dv, dbeta, dAkk, dGl, scale,
    cu_seqlens, chunk_indices, H, K, V, BKF: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One chunk, the feature axis in BKF blocks (outer loop) and the value axis in BV blocks (inner):
    per feature block only three [BT, BKF] accumulators are live (with BKF = 128 this is the single-block
    kernel measured before). The terms that need no feature index (dv, the dX part from U, dbeta's v
    part) are taken in the first feature block."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    DT = Vn.dtype.element_ty
    stk, stv = H * K, H * V
    b = load_rows(beta + i_h, t0, eos, H, BT)
    r = tl.arange(0, BT)
    X = tl.where(r[:, None] >= r[None, :], load_tile(Ainv + i_h * BT, t0, eos, H * BT, 0, BT, BT, BT), 0.0)
    Xt = tl.trans(X.to(DT))
    dX = tl.full([BT, BT], 0.0, tl.float32)
    db = tl.full([BT], 0.0, tl.float32)
    g_last_row = tl.minimum(t0 + BT, eos) - 1
    for k0 in range(0, K, BKF):
        dqg = tl.full([BT, BKF], 0.0, tl.float32)
        dkd = tl.full([BT, BKF], 0.0, tl.float32)
        dW = tl.full([BT, BKF], 0.0, tl.float32)
        dg_last = tl.full([BKF], 0.0, tl.float32)
        for v0 in range(0, V, BV):
            h = _kv_tile(Hc, i_c, i_h, H, K, V, k0, v0, BKF, BV).to(DT)
            dh = _kv_tile(dHc, i_c, i_h, H, K, V, k0, v0, BKF, BV).to(DT)
            do_t = load_tile(do + i_h * V, t0, eos, stv, v0, BT, V, BV).to(DT)
            vn = load_tile(Vn + i_h * V, t0, eos, stv, v0, BT, V, BV).to(DT)
            dvn = load_tile(dVn + i_h * V, t0, eos, stv, v0, BT, V, BV).to(DT)
            dqg += mma(do_t, tl.trans(h))
            dkd += mma(vn, tl.trans(dh))
            dW -= mma(dvn, tl.trans(h))
            dg_last += rsum(h.to(tl.float32) * dh.to(tl.float32), 1)
            if k0 == 0:
                v_t = load_tile(v + i_h * V, t0, eos, stv, v0, BT, V, BV)
                dX += mma(dvn, tl.trans((b[:, None] * v_t).to(DT)))
                dY = mma(Xt, dvn)
                store_tile(dv + i_h * V, b[:, None] * dY, t0, eos, stv, v0, BT, V, BV)
                db += rsum(v_t * dY, 1)
        # The [BT, BKF] input tiles are loaded only now and consumed one by one (register pressure).
        G_t = load_tile(G + i_h * K, t0, eos, stk, k0, BT, K, BKF)
        eG = tl.exp2(G_t)
        dq_t = scale * dqg * eG
        store_tile(dq + i_h * K, dq_t, t0, eos, stk, k0, BT, K, BKF)
        dG_t = load_tile(q + i_h * K, t0, eos, stk, k0, BT, K, BKF) * dq_t
        cols = k0 + tl.arange(0, BKF)
        g_last = tl.load(row_ptr(G + i_h * K, g_last_row, stk) + cols, mask=cols < K, other=0.0)
        kdf = decay_factor(G_t, g_last, t0, eos, BT, -1.0)
        k_t = load_tile(k + i_h * K, t0, eos, stk, k0, BT, K, BKF)
        dkd = dkd * kdf
        kdk = k_t * dkd
        dG_t -= kdk
        dg_last = dg_last * tl.exp2(g_last) + rsum(kdk, 0)
        tl.store(dGl + (i_c.to(tl.int64) * H + i_h) * K + cols, dg_last, mask=cols < K)
        keG = k_t * eG
        dX += mma(dW.to(DT), tl.trans((b[:, None] * keG).to(DT)))
        dXk = mma(Xt, dW.to(DT))
        store_tile(dk + i_h * K, dkd + b[:, None] * eG * dXk, t0, eos, stk, k0, BT, K, BKF)
        keG_dXk = keG * dXk
        store_tile(dG + i_h * K, dG_t + b[:, None] * keG_dXk, t0, eos, stk, k0, BT, K, BKF)
        db += rsum(keG_dXk, 1)
    store_tile(dbeta + i_h, db[:, None], t0, eos, H, 0, BT, 1, 1)
    # dL = -X^T dX X^T on its strictly lower part, at the intra precision (X can be large).
    Xf = tl.trans(X)
    dL = -pdot(Xf, pdot(dX, Xf, PREC), PREC)
    store_tile(dAkk + i_h * BT, tl.where(r[:, None] > r[None, :], dL, 0.0), t0, eos, H * BT, 0, BT, BT, BT)


@triton.jit
def _row_side(
    k,
    G,
    dAqk,
    dAkk,
    ti,
    tj,
    ref,
    eos,
    H,
    stk,
    D,
    BK: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    PREC: tl.constexpr,
):
    """Sub-tile (i, j) seen from its rows: dAqk_ij (k_j e^(ref - G_j)) and the same for dL."""
    kc = load_tile(k, tj, eos, stk, 0, BC, D, BK) * decay_factor(
        load_tile(G, tj, eos, stk, 0, BC, D, BK), ref, tj, eos, BC, -1.0
    )
    dAq = load_tile(dAqk, ti, eos, H * BT, 0, BC, BC, BC)
    dAk = load_tile(dAkk, ti, eos, H * BT, 0, BC, BC, BC)
    return pdot(dAq, kc, PREC), pdot(dAk, kc, PREC)


@triton.jit
def _col_side(
    q,
    k,
    G,
    beta,
    dAqk,
    dAkk,
    tj,
    ref,
    eos,
    H,
    stk,
    D,
    BK: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    PREC: tl.constexpr,
):
    """Sub-tile (j, i) seen from its columns: dAqk_ji^T (q_j e^(G_j - ref)) + dL_ji^T (beta k_j e^(G_j - ref))."""
    f = decay_factor(load_tile(G, tj, eos, stk, 0, BC, D, BK), ref, tj, eos, BC, 1.0)
    qf = load_tile(q, tj, eos, stk, 0, BC, D, BK) * f
    b = load_rows(beta, tj, eos, H, BC)
    kf = b[:, None] * load_tile(k, tj, eos, stk, 0, BC, D, BK) * f
    dAq = load_tile(dAqk, tj, eos, H * BT, 0, BC, BC, BC)
    dAk = load_tile(dAkk, tj, eos, H * BT, 0, BC, BC, BC)
    return pdot(tl.trans(dAq), qf, PREC) + pdot(tl.trans(dAk), kf, PREC)


# restore_value: the kernel adds into dG in place, and autotuning runs it once per config
@triton.autotune(
    configs=launch.configs("_intra_bwd_kernel"),
    key=["H", "K", "PREC"],
    restore_value=["dG"],
    prune_configs_by=launch.prune("_intra_bwd_kernel"),
)
@triton.jit
def _intra_bwd_kernel(
    q, k, G, beta, dAqk, dAkk, dq_p, dk_p, dG, db_p, dq, dk, dbk, TH, cu_seqlens, chunk_indices,
    H, K, BKB: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Sub-tile row I of a chunk and feature block i_k: the Aqk
    and L terms of dq, dk, dbeta, and dG before the within-chunk reverse cumulative sum (`_dg_kernel`),
    written over the partial dG in place. Every term is separable over features except dbeta, whose
    per-block partial sums go to dbk[i_k] (summed by `_dg_kernel`)."""
    # a chunk's programs are adjacent in launch order (axis 0 = chunk * P + block), so the tiles they
    # all re-read (k, G of the other sub-tiles) are still in L2
    P = (K + BKB - 1) // BKB * (BT // BC)
    i_c, i_ki, i_h = tl.program_id(0) // P, tl.program_id(0) % P, tl.program_id(1)
    i_k, I = i_ki // (BT // BC), i_ki % (BT // BC)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    ti = t0 + I * BC
    if ti >= eos:
        return
    k0 = i_k * BKB
    Kr = K - k0  # the feature block's columns: pointers offset by k0, masks against K - k0
    q, k, G, beta = q + i_h * K + k0, k + i_h * K + k0, G + i_h * K + k0, beta + i_h
    dAqk, dAkk = dAqk + i_h * BT, dAkk + i_h * BT
    dq_p, dk_p, dG, db_p = dq_p + i_h * K + k0, dk_p + i_h * K + k0, dG + i_h * K + k0, db_p + i_h
    dq, dk, dbk = dq + i_h * K + k0, dk + i_h * K + k0, dbk + i_k.to(tl.int64) * TH + i_h
    stk = H * K
    # rows of sub-tile row I, off-diagonal columns referred to the tile's first row
    ref_o = load_row(G, ti, stk, Kr, BKB)
    dq_o = tl.full([BC, BKB], 0.0, tl.float32)
    P_o = tl.full([BC, BKB], 0.0, tl.float32)
    for j in range(0, I):
        a, p = _row_side(
            k, G, dAqk + j * BC, dAkk + j * BC, ti, t0 + j * BC, ref_o, eos, H, stk, Kr, BKB, BT, BC, PREC
        )
        dq_o += a
        P_o += p
    G_i = load_tile(G, ti, eos, stk, 0, BC, Kr, BKB)
    f_o = decay_factor(G_i, ref_o, ti, eos, BC, 1.0)
    ref_m = load_row(G, tl.minimum(ti + BC // 2, eos - 1), stk, Kr, BKB)
    f_m = decay_factor(G_i, ref_m, ti, eos, BC, 1.0)
    a, p = _row_side(k, G, dAqk + I * BC, dAkk + I * BC, ti, ti, ref_m, eos, H, stk, Kr, BKB, BT, BC, PREC)
    dq_i = dq_o * f_o + a * f_m
    P = P_o * f_o + p * f_m
    # columns of sub-tile column I, later rows referred to the tile's last row
    ref_c = load_row(G, tl.minimum(ti + BC - 1, eos - 1), stk, Kr, BKB)
    dAq_I, dAk_I = dAqk + I * BC, dAkk + I * BC
    dkc_o = tl.full([BC, BKB], 0.0, tl.float32)
    for j in range(I + 1, BT // BC):
        dkc_o += _col_side(
            q, k, G, beta, dAq_I, dAk_I, t0 + j * BC, ref_c, eos, H, stk, Kr, BKB, BT, BC, PREC
        )
    dkc = dkc_o * decay_factor(G_i, ref_c, ti, eos, BC, -1.0)
    d = _col_side(q, k, G, beta, dAq_I, dAk_I, ti, ref_m, eos, H, stk, Kr, BKB, BT, BC, PREC)
    dkc += d * decay_factor(G_i, ref_m, ti, eos, BC, -1.0)
    q_i = load_tile(q, ti, eos, stk, 0, BC, Kr, BKB)
    k_i = load_tile(k, ti, eos, stk, 0, BC, Kr, BKB)
    b_i = load_rows(beta, ti, eos, H, BC)
    dk_row = b_i[:, None] * P
    dG_i = q_i * dq_i + k_i * (dk_row - dkc) + load_tile(dG, ti, eos, stk, 0, BC, Kr, BKB)
    store_tile(dG, dG_i, ti, eos, stk, 0, BC, Kr, BKB)
    store_tile(dq, dq_i + load_tile(dq_p, ti, eos, stk, 0, BC, Kr, BKB), ti, eos, stk, 0, BC, Kr, BKB)
    store_tile(dk, dk_row + dkc + load_tile(dk_p, ti, eos, stk, 0, BC, Kr, BKB), ti, eos, stk, 0, BC, Kr, BKB)
    db = rsum(k_i * P, 1)
    if i_k == 0:
        db += load_rows(db_p, ti, eos, H, BC)
    store_tile(dbk, db[:, None], ti, eos, H, 0, BC, 1, 1)


@triton.jit
def _dg_kernel(
    dG, dGl, dg, dbk, dbeta, NK, TH, cu_seqlens, chunk_indices, H, K, BK: tl.constexpr, BT: tl.constexpr
):
    """dg = reverse cumulative sum of dG within the chunk, plus the carry dGl from the chunk's end:
    e^(G_C) feeds every position of the chunk. dbeta = the sum of the NK feature blocks' partials."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = chunk_bounds(cu_seqlens, chunk_indices, i_c, BT)
    rk = tl.arange(0, BK)
    carry = tl.load(dGl + (i_c.to(tl.int64) * H + i_h) * K + rk, mask=rk < K, other=0.0)
    dG_t = load_tile(dG + i_h * K, t0, eos, H * K, 0, BT, K, BK)
    store_tile(dg + i_h * K, rcumsum(dG_t, 0, True) + carry[None, :], t0, eos, H * K, 0, BT, K, BK)
    db = load_rows(dbk + i_h, t0, eos, H, BT)
    for i_k in range(1, NK):
        db += load_rows(dbk + i_k * TH + i_h, t0, eos, H, BT)
    store_tile(dbeta + i_h, db[:, None], t0, eos, H, 0, BT, 1, 1)


def kda_bwd(q, k, v, g, beta, scale: float, h0, plan: ChunkPlan, saved: dict, do, dht):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) for tokens flattened to [T, H, *]."""
    T, H, K = q.shape
    V = v.shape[-1]
    NC, N = plan.num_chunks, plan.num_seqs
    BK = block_size(K)
    dt, dev, f32 = q.dtype, q.device, torch.float32
    prec = intra_precision(dt)
    cu, ci = plan.cu_seqlens_N1, plan.chunk_indices_C2
    dAqk = torch.empty(T, H, BT, device=dev, dtype=f32)
    dVi = torch.empty(T, H, V, device=dev, dtype=dt)
    if NC > 0:
        _dav_kernel[(NC, H)](saved["Aqk"], saved["Vn"], do, dAqk, dVi, scale, cu, ci, H, V, BT=BT)
    dHc = torch.empty(NC, H, K, V, device=dev, dtype=dt)
    dVn = torch.empty(T, H, V, device=dev, dtype=dt)
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=f32) if h0 is not None else None
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * H)
    _state_bwd_kernel[grid](
        saved["Qg"], saved["Kd"], saved["G"], saved["W"], do, dVi, dht if dht is not None else dVi, dHc, dVn,
        dh0 if dh0 is not None else dVi, scale, cu, plan.chunk_offsets_N1, H, K, V,
        BK=BK, BT=BT, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None,
    )  # fmt: skip
    dq_p, dk_p, dG_p = (torch.empty(T, H, K, device=dev, dtype=f32) for _ in range(3))
    db_p, dv = torch.empty(T, H, device=dev, dtype=f32), torch.empty_like(v)
    dAkk, dGl = torch.empty(T, H, BT, device=dev, dtype=f32), torch.empty(NC, H, K, device=dev, dtype=f32)
    dq, dk, dg, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g), torch.empty_like(beta)
    if NC > 0:
        _main_bwd_kernel[(NC, H)](
            q, k, v, saved["G"], beta, saved["Ainv"], saved["Hc"], dHc, saved["Vn"], dVn, do,
            dq_p, dk_p, dG_p, dv, db_p, dAkk, dGl, scale, cu, ci, H, K, V, BT=BT, PREC=prec,
        )  # fmt: skip
        # dbeta partials, one slot per feature block of the narrowest block the autotuner may pick
        bkb_min = min(c.kwargs["BKB"] for c in _intra_bwd_kernel.configs)
        dbk = torch.empty(triton.cdiv(K, bkb_min), T, H, device=dev, dtype=f32)
        grid_i = lambda meta: (NC * triton.cdiv(K, meta["BKB"]) * (BT // BC), H)
        _intra_bwd_kernel[grid_i](
            q, k, saved["G"], beta, dAqk, dAkk, dq_p, dk_p, dG_p, db_p, dq, dk, dbk, T * H, cu, ci,
            H, K, BT=BT, BC=BC, PREC=prec,
        )  # fmt: skip
        NK = triton.cdiv(K, _intra_bwd_kernel.best_config.kwargs["BKB"])
        _dg_kernel[(NC, H)](dG_p, dGl, dg, dbk, dbeta, NK, T * H, cu, ci, H, K, BK=BK, BT=BT)
    return dq, dk, dv, dg, dbeta, dh0
