"""Triton latent MLA decode over vLLM's paged cache: split-KV (flash-decoding), each latent read once.

The function is ``kernels.mla.naive.latent_decode_naive``. Two launches:

* ``_latent_split`` over (sequence, split): the split's share of the sequence's tokens in tiles of
  ``TILE`` rows, each tile's rows read once as [c_kv | k_pe]; scores for all H query heads at once
  (``q_lat . c_kv + q_pe . k_pe``, two tensor-core products), an online softmax, and the value product
  on the same c_kv tile (V = c_kv: no second page is read). It writes the split's unnormalised sum,
  running max and denominator (fp32).
* ``_latent_combine`` over (sequence, head): the splits merged by their maxima, written to the output's
  first ``rank`` columns, zeros after them.

Why not vLLM's Triton kernel: it pads the head to a power of two (320 -> 512 columns for gpu_1b's
256 + 64), multiplies the padding, and streams the V pages beside the K pages. Here the columns are
split at ``rank`` and only the K pages are read: 640 bytes a token and layer in bf16 at gpu_1b.

Split count fixed per call (``SPLITS`` by default), each split's length derived in the kernel from ``seqused_k``,
so a captured CUDA graph replays for any context lengths. fp32 inputs multiply in IEEE fp32, half inputs
on the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the launch: bench/mla_decode.py on an H100 (2026-12-07, gpu_1b's latent shape in 1280-token pages): 64-token
# tiles on two pipeline stages 7-9% faster than 32-token tiles on Triton's default three at 64 x 1,024 to 128 x
# 3,584 (30.1 / 71.1 / 130.4 us against 32.4 / 78.4 / 141.8); 8 or 32 splits a sequence slower than 16
SPLITS = 16
TILE = 64
WARPS = 4
STAGES = 2
LOG2E = 1.4426950408889634
# tl.max / tl.sum are @jit functions of triton.language.standard, run by the interpreter only if
# TRITON_INTERPRET was set before triton was imported: tl.reduce with the combine functions instead.
_max_combine, _sum_combine = tl.standard._elementwise_max, tl.standard._sum_combine


@triton.jit
def _latent_split(q_ptr, k_ptr, cu_q_ptr, used_ptr, table_ptr, acc_ptr, m_ptr, l_ptr, H, sq_t, sq_h, sk_b, sk_n,
                  st_s, scale_log2, RANK: tl.constexpr, ROPE: tl.constexpr, RP: tl.constexpr, EP: tl.constexpr,
                  HP: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                  PREC: tl.constexpr):  # fmt: skip
    s = tl.program_id(0)
    p = tl.program_id(1)
    t0 = tl.load(cu_q_ptr + s)
    live = tl.load(cu_q_ptr + s + 1) > t0
    n = tl.where(live, tl.load(used_ptr + s), 0)
    per = ((n + SPLITS - 1) // SPLITS + TILE - 1) // TILE * TILE  # tokens a split, whole tiles
    lo = p * per
    hi = tl.minimum(lo + per, n)
    h = tl.arange(0, HP)
    r = tl.arange(0, RP)
    e = tl.arange(0, EP)
    hm, rm, em = h < H, r < RANK, e < ROPE
    qm = h < tl.where(live, H, 0)  # a padding entry's t0 is past the queries: nothing read
    q_row = q_ptr + t0.to(tl.int64) * sq_t + h[:, None] * sq_h
    q_lat = tl.load(q_row + r[None, :], mask=qm[:, None] & rm[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + e[None, :], mask=qm[:, None] & em[None, :], other=0.0)
    m_i = tl.full([HP], float("-inf"), dtype=tl.float32)
    l_i = tl.full([HP], 0.0, dtype=tl.float32)
    acc = tl.full([HP, RP], 0.0, dtype=tl.float32)
    for start in range(lo, hi, TILE):
        j = start + tl.arange(0, TILE)
        jm = j < hi
        page = tl.load(table_ptr + s.to(tl.int64) * st_s + j // BLOCK, mask=jm, other=0).to(tl.int64)
        row = k_ptr + page * sk_b + (j % BLOCK).to(tl.int64) * sk_n
        k_lat = tl.load(row[:, None] + r[None, :], mask=jm[:, None] & rm[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + RANK + e[None, :], mask=jm[:, None] & em[None, :], other=0.0)
        sc = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
        sc += tl.dot(q_pe, tl.trans(k_pe), input_precision=PREC)
        sc = tl.where(jm[None, :], sc * scale_log2, float("-inf"))  # base-2 logits
        m_new = tl.maximum(m_i, tl.reduce(sc, 1, _max_combine))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(pr, 1, _sum_combine)
        acc = acc * alpha[:, None] + tl.dot(pr.to(k_lat.dtype), k_lat, input_precision=PREC)
        m_i = m_new
    part = (s * SPLITS + p).to(tl.int64) * H + h
    tl.store(acc_ptr + part[:, None] * RP + r[None, :], acc, mask=hm[:, None])
    tl.store(m_ptr + part, m_i, mask=hm)
    tl.store(l_ptr + part, l_i, mask=hm)


@triton.jit
def _latent_combine(acc_ptr, m_ptr, l_ptr, cu_q_ptr, used_ptr, out_ptr, H, D, so_t, so_h, RANK: tl.constexpr,
                    RP: tl.constexpr, ZP: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
    s = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(cu_q_ptr + s)
    live = (tl.load(cu_q_ptr + s + 1) > t0) & (tl.load(used_ptr + s) > 0)
    sp = tl.arange(0, SPLITS)
    part = (s * SPLITS + sp).to(tl.int64) * H + h
    m = tl.load(m_ptr + part)
    big = tl.reduce(m, 0, _max_combine)
    w = tl.where(m > float("-inf"), tl.exp2(m - big), 0.0)  # empty splits weigh nothing
    denom = tl.reduce(w * tl.load(l_ptr + part), 0, _sum_combine)
    r = tl.arange(0, RP)
    acc = tl.load(acc_ptr + part[:, None] * RP + r[None, :])
    o = tl.reduce(w[:, None] * acc, 0, _sum_combine) / tl.where(denom > 0, denom, 1.0)
    dst = out_ptr + t0.to(tl.int64) * so_t + h * so_h
    tl.store(dst + r, o.to(out_ptr.dtype.element_ty), mask=r < tl.where(live, RANK, 0))
    z = RANK + tl.arange(0, ZP)  # the value's padding columns
    tl.store(dst + z, tl.full([ZP], 0.0, dtype=out_ptr.dtype.element_ty), mask=z < tl.where(live, D, 0))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def latent_decode_triton(
    q_THD: torch.Tensor, k_cache_BNKD: torch.Tensor, out_THD: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor, block_table: torch.Tensor, scale: float, rank: int, rope: int, tile: int = TILE,
    warps: int = WARPS, stages: int | None = STAGES, splits: int = SPLITS,
) -> torch.Tensor:  # fmt: skip
    """``latent_decode_naive`` in two launches, nothing read back to the host (safe in a captured CUDA graph).
    q, out: [T, H, D] with a contiguous last dim; the cache [blocks, block size, 1, D'] with any row strides
    (vLLM's K half of an interleaved K|V page); at most one query token a sequence. ``tile`` (tokens a step of the
    split's loop), ``warps``, ``stages`` (software pipelining; None: Triton's default) and ``splits`` (programs a
    sequence, a power of two) are the launch shape (``bench/mla_decode.py`` sweeps them)."""
    H, D = q_THD.shape[1:]
    S = seqused_k.shape[0]
    if k_cache_BNKD.ndim != 4 or k_cache_BNKD.shape[2] != 1 or rank + rope > min(D, k_cache_BNKD.shape[3]):
        raise ValueError(f"latent decode: one KV head of at least rank + rope = {rank} + {rope} columns, got "
                         f"cache {tuple(k_cache_BNKD.shape)} and queries {tuple(q_THD.shape)}")  # fmt: skip
    if q_THD.stride(-1) != 1 or out_THD.stride(-1) != 1 or k_cache_BNKD.stride(-1) != 1:
        raise ValueError("latent decode: queries, output and cache need a contiguous last dimension")
    if tuple(cu_seqlens_q.shape) != (S + 1,) or block_table.shape[0] < S:
        raise ValueError(f"latent decode: {S} sequences, cu_seqlens_q {tuple(cu_seqlens_q.shape)}, "
                         f"block table {tuple(block_table.shape)}")  # fmt: skip
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"latent decode: splits must be a power of two, got {splits}")
    if S == 0:
        return out_THD
    RP = _pow2(rank)
    acc = torch.empty(S, splits, H, RP, device=q_THD.device, dtype=torch.float32)
    m = torch.empty(S, splits, H, device=q_THD.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    prec = "ieee" if q_THD.dtype == torch.float32 else "tf32"  # tf32 is ignored for half inputs
    pipelining = {} if stages is None else {"num_stages": stages}
    _latent_split[(S, splits)](
        q_THD, k_cache_BNKD, cu_seqlens_q, seqused_k, block_table, acc, m, l_, H, q_THD.stride(0),
        q_THD.stride(1), k_cache_BNKD.stride(0), k_cache_BNKD.stride(1), block_table.stride(0), scale * LOG2E,
        RANK=rank, ROPE=rope, RP=RP, EP=_pow2(rope), HP=_pow2(H), BLOCK=k_cache_BNKD.shape[1], TILE=tile,
        SPLITS=splits, PREC=prec, num_warps=warps, **pipelining,
    )  # fmt: skip
    _latent_combine[(S, H)](
        acc, m, l_, cu_seqlens_q, seqused_k, out_THD, H, D, out_THD.stride(0), out_THD.stride(1), RANK=rank,
        RP=RP, ZP=_pow2(max(D - rank, 1), 1), SPLITS=splits,
    )  # fmt: skip
    return out_THD
