"""Shared Triton helpers and host-side index preparation for the KDA kernels.

Layout: every kernel sees tokens flattened to one axis (B*T rows), so fixed-length batches are just
packed sequences with cu_seqlens = [0, T, 2T, ...]. A chunk never crosses a sequence boundary;
`chunk_indices[c] = (sequence, chunk within sequence)` drives the chunk-parallel kernels and
`chunk_offsets[n]` locates sequence n's first chunk in the per-chunk state buffers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.transfer import to_device

BT = 64  # chunk length of the state pass
BC = 16  # diagonal sub-tile length: with g >= G_MIN a tile spans at most 16*|G_MIN| nats
G_MIN = -5.0  # contract: every log-decay g >= G_MIN (checked when LONGHORIZON_KDA_DEBUG=1)
LOG2E = 1.4426950408889634

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def debug_enabled() -> bool:
    """Debug mode checks the gate contract (a device sync); LONGHORIZON_KDA_CHECK is the CPU path's switch."""
    return any(
        os.environ.get(name, "0") not in ("", "0")
        for name in ("LONGHORIZON_KDA_DEBUG", "LONGHORIZON_KDA_CHECK")
    )


@dataclass
class ChunkPlan:
    """Where the chunks of a packed batch live. Tensors are int32 on the input's device."""

    cu_seqlens_N1: torch.Tensor  # [N + 1] token offsets of the sequences
    chunk_indices_C2: torch.Tensor  # [NC, 2] (sequence, chunk within the sequence)
    chunk_offsets_N1: torch.Tensor  # [N + 1] first global chunk of each sequence
    num_seqs: int
    num_chunks: int


_PLAN_CACHE: list[tuple[tuple, torch.Tensor | None, ChunkPlan]] = []  # most recent first
_PLAN_CACHE_SIZE = 8
_HOST_BOUNDS: list[tuple[torch.Tensor, list[int]]] = []  # innermost last: ``host_bounds`` scopes


@contextlib.contextmanager
def host_bounds(cu_seqlens: torch.Tensor | None, bounds: list[int] | None):
    """Within the block, ``plan_chunks`` takes ``bounds`` (the caller's host copy of this very tensor's values) for
    ``cu_seqlens`` instead of reading an inference tensor back from the device: a rollout engine's KDA layers
    (``model.kda._kda_kernel``) have their step's offsets on the host already, and the kernel's plan lookups, two
    a layer, would otherwise sync the device each. Scoped to the block, because an inference tensor may be
    changed in place afterwards without a trace; nothing in the block may change it."""
    if cu_seqlens is None or bounds is None:
        yield
        return
    _HOST_BOUNDS.append((cu_seqlens, bounds))
    try:
        yield
    finally:
        _HOST_BOUNDS.pop()


def _scoped_bounds(cu_seqlens: torch.Tensor) -> list[int] | None:
    for t, bounds in reversed(_HOST_BOUNDS):
        if t is cu_seqlens:
            return bounds
    return None


def plan_chunks(
    B: int,
    T: int,
    cu_seqlens: torch.Tensor | None,
    device: torch.device,
    bounds: list[int] | None = None,
    chunks_to: int | None = None,
) -> ChunkPlan:
    """Chunk layout, cached so that every KDA layer of a step, and its backward, share one plan.

    A normal cu_seqlens tensor is keyed by identity and version (holding a reference so the identity
    cannot be reused): a hit costs no device sync. An inference tensor (made under
    ``torch.inference_mode``, as vLLM's attention metadata is) has no version counter and can be
    changed in place inside inference mode without a trace, so its identity proves nothing: it is
    keyed by its values: ``bounds`` when given, or inside a ``host_bounds`` block for it, else read with the one
    host copy a build needs anyway (one device sync per call, no rebuild on a hit). Without cu_seqlens the key
    is (B, T) and nothing syncs. A miss validates cu_seqlens and builds the plan. ``bounds``: the caller's host
    copy of cu_seqlens (the model's sequence layout has one), so that nothing reads the device tensor. ``chunks_to``:
    the plan's chunk list padded to this length (a static shape for CUDA graphs, ``padded_chunk_count``) with
    empty chunks past the last sequence's end, which every kernel masks out."""
    if cu_seqlens is not None and cu_seqlens.is_inference():
        if bounds is None:
            bounds = _scoped_bounds(cu_seqlens)
        bounds = _bounds(cu_seqlens) if bounds is None else [int(b) for b in bounds]
        if len(bounds) != cu_seqlens.numel():
            raise ValueError(f"host bounds {bounds} are not the {cu_seqlens.numel()} offsets of cu_seqlens")
        key, ref = (B, T, str(device), chunks_to, "values", tuple(bounds)), None
    else:
        key, ref = (B, T, str(device), chunks_to, None if cu_seqlens is None else cu_seqlens._version), cu_seqlens
    for i, (k, cu, plan) in enumerate(_PLAN_CACHE):
        if k == key and cu is ref:
            if i:
                _PLAN_CACHE.insert(0, _PLAN_CACHE.pop(i))
            return plan
    plan = _build_plan(B, T, cu_seqlens, device, bounds, chunks_to)
    _PLAN_CACHE.insert(0, (key, ref, plan))
    del _PLAN_CACHE[_PLAN_CACHE_SIZE:]
    return plan


def _bounds(cu_seqlens: torch.Tensor) -> list[int]:
    if cu_seqlens.ndim != 1 or len(cu_seqlens) < 1:
        raise ValueError(
            f"cu_seqlens must be a 1-d tensor of sequence offsets, got shape {tuple(cu_seqlens.shape)}"
        )
    return [int(x) for x in cu_seqlens.tolist()]


def padded_chunk_count(T: int, num_seqs: int) -> int:
    """The most chunks ``num_seqs`` packed sequences of ``T`` tokens in all can take: each sequence's last chunk
    may be partial, so sum(ceil(len / BT)) <= ceil(T / BT) + num_seqs. A plan padded to it has one shape for
    every layout of (T, num_seqs)."""
    return -(-T // BT) + num_seqs


def _build_plan(
    B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device, bounds: list[int] | None, chunks_to: int | None
) -> ChunkPlan:
    i32 = dict(device=device, dtype=torch.int32)
    if cu_seqlens is None:
        per_seq = (T + BT - 1) // BT
        total = B * per_seq
        chunk = torch.arange(total, **i32)
        indices = torch.stack([chunk // max(per_seq, 1), chunk % max(per_seq, 1)], 1).contiguous()
        cu = torch.arange(0, B + 1, **i32) * T
        return ChunkPlan(cu, indices, torch.arange(0, B + 1, **i32) * per_seq, B, total)
    bounds = _bounds(cu_seqlens) if bounds is None else bounds
    if B != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need B == 1, got B = {B}")
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"cu_seqlens must run from 0 to T = {T}, got {bounds}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    indices, offsets = [], [0]
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        n_chunks = (b - a + BT - 1) // BT
        indices.extend((n, c) for c in range(n_chunks))
        offsets.append(offsets[-1] + n_chunks)
    if chunks_to is not None:
        indices = _pad_chunks(indices, bounds, chunks_to)
    host = dict(dtype=torch.int32)
    indices_C2 = to_device(torch.tensor(indices, **host).reshape(-1, 2), device)
    return ChunkPlan(
        to_device(torch.tensor(bounds, **host), device),
        indices_C2.contiguous(),
        to_device(torch.tensor(offsets, **host), device),
        len(bounds) - 1,
        len(indices),
    )


def _pad_chunks(indices: list[tuple[int, int]], bounds: list[int], chunks_to: int) -> list[tuple[int, int]]:
    """``indices`` padded to ``chunks_to`` entries with chunks of the last sequence that start at or past its end:
    their programs load nothing and store nothing (every tile is masked to the sequence's end), and no sequence's
    chunk range (``chunk_offsets``) reaches them, so the state passes never read their slots."""
    if chunks_to < len(indices):
        raise ValueError(f"chunks_to = {chunks_to} is less than the plan's {len(indices)} chunks")
    n = len(bounds) - 2
    if n < 0:
        raise ValueError("padding a chunk plan needs at least one sequence")
    first = -(-(bounds[-1] - bounds[-2]) // BT)  # the last sequence's chunk count: the empty ones come after
    return indices + [(n, first + j) for j in range(chunks_to - len(indices))]


def block_size(n: int) -> int:
    """Padded tile width of a feature axis (tl.dot needs at least 16)."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def chunk_bounds(cu_seqlens, chunk_indices, i_c, BT: tl.constexpr):
    """First token of chunk i_c and the end of its sequence (global row indices)."""
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int32)
    i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int32)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    return bos + i_t * BT, eos


@triton.jit
def row_ptr(ptr, t, stride_t):
    """ptr + t * stride_t with the product in int64: token rows times H * K pass 2^31 from about 175k
    tokens at H = 96, K = 128. Offsets within a tile stay int32."""
    return ptr + t.to(tl.int64) * stride_t


@triton.jit
def load_tile(ptr, t0, eos, stride_t, col0, NR: tl.constexpr, D, BD: tl.constexpr):
    """Rows t0..t0+NR (masked at eos) and columns col0..col0+BD (masked at D) as fp32."""
    r = tl.arange(0, NR)
    cols = col0 + tl.arange(0, BD)
    mask = ((t0 + r)[:, None] < eos) & (cols[None, :] < D)
    ptrs = row_ptr(ptr, t0, stride_t) + r[:, None] * stride_t + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_tile(ptr, x, t0, eos, stride_t, col0, NR: tl.constexpr, D, BD: tl.constexpr):
    r = tl.arange(0, NR)
    cols = col0 + tl.arange(0, BD)
    mask = ((t0 + r)[:, None] < eos) & (cols[None, :] < D)
    ptrs = row_ptr(ptr, t0, stride_t) + r[:, None] * stride_t + cols[None, :]
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_rows(ptr, t0, eos, stride_t, NR: tl.constexpr):
    """A per-token scalar (beta) for rows t0..t0+NR as fp32."""
    r = tl.arange(0, NR)
    return tl.load(row_ptr(ptr, t0, stride_t) + r * stride_t, mask=(t0 + r) < eos, other=0.0).to(tl.float32)


@triton.jit
def load_row(ptr, t, stride_t, D, BD: tl.constexpr):
    cols = tl.arange(0, BD)
    return tl.load(row_ptr(ptr, t, stride_t) + cols, mask=cols < D, other=0.0).to(tl.float32)


@triton.jit
def decay_factor(G, ref, t0, eos, NR: tl.constexpr, SIGN: tl.constexpr):
    """exp2(SIGN * (G - ref)) on valid rows and 0 on rows past eos (whose G is a masked 0 and
    would otherwise overflow against a very negative reference)."""
    valid = (t0 + tl.arange(0, NR))[:, None] < eos
    return tl.where(valid, tl.exp2(tl.where(valid, SIGN * (G - ref[None, :]), 0.0)), 0.0)


# Reductions through tl.reduce / tl.associative_scan rather than tl.sum / tl.cumsum / tl.zeros / tl.cdiv:
# those are @jit functions of triton.language.standard, interpretable only if TRITON_INTERPRET was set
# before triton itself was imported. The combine function is the standard library's own, so the compiled
# code is tl.sum's and the interpreter still recognises it and calls numpy instead of a Python loop.
# With these the kernels run in the interpreter whenever *this* package is imported with it set.
_sum_combine = tl.standard._sum_combine


@triton.jit
def rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def rcumsum(x, axis: tl.constexpr, reverse: tl.constexpr):
    return tl.associative_scan(x, axis, _sum_combine, reverse)


# Precision of the products whose errors cancel (intra-chunk sub-tiles, dL): 0 = bf16 operands,
# 1 = fp32 operands with tf32 products, 2 = bf16x3 (hi/lo split, three bf16 products: ~16 mantissa bits
# on bf16 tensor cores), 3 = fp32 "ieee" (fp32 inputs and the interpreter). See intra_precision().
PREC_BF16, PREC_TF32, PREC_BF16X3, PREC_IEEE = 0, 1, 2, 3
_PREC_NAMES = {"bf16": PREC_BF16, "tf32": PREC_TF32, "bf16x3": PREC_BF16X3, "ieee": PREC_IEEE}


def intra_precision(dtype: torch.dtype) -> int:
    """bf16x3 by default for half-precision inputs; LONGHORIZON_KDA_INTRA_PREC overrides (bf16, tf32,
    bf16x3, ieee). fp32 inputs always use ieee."""
    if dtype not in (torch.bfloat16, torch.float16):
        return PREC_IEEE
    name = os.environ.get("LONGHORIZON_KDA_INTRA_PREC", "bf16x3")
    if name not in _PREC_NAMES:
        raise ValueError(f"LONGHORIZON_KDA_INTRA_PREC must be one of {sorted(_PREC_NAMES)}, got {name!r}")
    return _PREC_NAMES[name]


@triton.jit
def _split_bf16(x):
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


FP32_PRODUCTS = ("bf16x3", "ieee")


def fp32_products() -> str:
    """How ``mma`` multiplies fp32 tiles on a GPU: "bf16x3" (the default, see ``mma``) or "ieee" (fp32 FMA,
    LONGHORIZON_KDA_FP32_PRODUCTS=ieee). bf16x3 rounds each operand's low part to bf16, so a last-bit change
    of an input can move a product by ~2^-16 of its size: two fp32 engines whose inputs differ in the last
    bit (an eager and a compiled one) then differ by ~1e-5, enough to flip a near-tied router; IEEE keeps
    such differences at the last bits. Read once, at import."""
    name = os.environ.get("LONGHORIZON_KDA_FP32_PRODUCTS", "bf16x3")
    if name not in FP32_PRODUCTS:
        raise ValueError(f"LONGHORIZON_KDA_FP32_PRODUCTS must be one of {list(FP32_PRODUCTS)}, got {name!r}")
    return name


# fp32 products on the GPU are split into bf16 hi/lo parts unless fp32_products() says ieee (see mma); the
# interpreter computes them in IEEE
FP32_SPLIT = tl.constexpr(not INTERPRET and fp32_products() == "bf16x3")


@triton.jit
def mma(a, b):
    """a @ b with an fp32 result at the operands' own precision: one tensor-core product for bf16/fp16
    operands; for fp32 operands IEEE fp32 in the interpreter and "bf16x3" on the GPU (three bf16
    tensor-core products of the hi/lo split, about 16 mantissa bits; IEEE where fp32_products() is "ieee").
    Deviation from a plain ``tl.dot``, whose fp32 default is TF32: on the H200 (Triton 3.6) TF32 made the
    fp32 kernels only ~2e-3 relative, and the fp32 state kernel's TF32 variants hit an illegal memory access
    while the autotuner benchmarked them at 8192 packed tokens (bf16 ran); IEEE fp32 products (FMA) took
    minutes to compile for the autotuner's configs. bf16 products are what the bf16 kernels already run."""
    if a.dtype == tl.float32:
        if FP32_SPLIT:
            return pdot(a, b, 2)
        else:
            return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def pdot(a, b, PREC: tl.constexpr):
    """a @ b for fp32 tiles at the chosen precision, fp32 result."""
    if PREC == 0:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif PREC == 2:
        a_hi, a_lo = _split_bf16(a.to(tl.float32))
        b_hi, b_lo = _split_bf16(b.to(tl.float32))
        return tl.dot(a_hi, b_hi) + tl.dot(a_hi, b_lo) + tl.dot(a_lo, b_hi)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
