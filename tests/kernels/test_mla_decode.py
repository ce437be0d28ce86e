"""Triton latent MLA decode (kernels/mla/triton.py) under TRITON_INTERPRET=1 against the PyTorch reference
(kernels/mla/naive.py), and the reference against plain softmax attention over the gathered latents.

The cache is laid out as vLLM 0.26's Triton backend hands it over: K and V interleaved in each token's row
([blocks, heads, block, 2 * D] viewed as [blocks, block, heads, 2 * D] and split), so the K pages have row strides
the kernel must follow; pages in a shuffled order; contexts of 1, 15, 64, 65 and 300 tokens (fewer tokens than
splits, one tile, a partial tile, many tiles), a padded batch entry (no query token) whose output row stays as it
was, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from kernels.mla.naive import latent_decode_naive
from kernels.testing import assert_close, import_interpreted

triton = pytest.importorskip("triton")
(MLA,) = import_interpreted("kernels.mla.triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

CONTEXTS = [1, 15, 64, 65, 300]
BLOCK = 16


def paged_case(H: int, rank: int, rope: int, D: int, dtype=torch.float32, seed: int = 0):
    """Queries, the K pages (a strided view), an output pre-filled with a sentinel, and the batch metadata:
    one query token per context in CONTEXTS plus a padding entry (no query token) in the middle."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // BLOCK) for n in CONTEXTS]
    blocks = sum(pages) + 3
    kv = torch.zeros(blocks, 1, BLOCK, 2 * D)
    kv[..., : rank + rope] = torch.randn(blocks, 1, BLOCK, rank + rope, generator=g)
    kv[..., D : D + rank] = kv[..., :rank]  # V = c_kv (the kernel must not need it)
    k_cache = kv.to(dtype).transpose(1, 2).split(D, dim=-1)[0]
    order = torch.randperm(blocks, generator=g)
    used = [*CONTEXTS[:2], 7, *CONTEXTS[2:]]  # entry 2 is the padding: its used length is ignored
    table = torch.zeros(len(used), max(pages), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages):
        table[i + (i >= 2), :n] = order[at : at + n].to(torch.int32)
        at += n
    starts = [0, 1, 2, 2, 3, 4, 5]  # entry 2 has no query token
    T = len(CONTEXTS)
    q = torch.zeros(T, H, D, dtype=dtype)
    q[..., : rank + rope] = torch.randn(T, H, rank + rope, generator=g).to(dtype)
    out = torch.full((T, H, D), 7.0, dtype=dtype)
    return q, k_cache, out, torch.tensor(starts, dtype=torch.int32), torch.tensor(used, dtype=torch.int32), table


def test_reference_is_softmax_attention_over_the_latents():
    H, rank, rope, D = 3, 24, 8, 40
    q, k_cache, out, starts, used, table = paged_case(H, rank, rope, D)
    latent_decode_naive(q, k_cache, out, starts, used, table, 0.3, rank, rope)
    flat = k_cache.reshape(-1, D)
    for t, (i, n) in enumerate([(0, 1), (1, 15), (3, 64), (4, 65), (5, 300)]):
        rows = torch.cat([table[i, j].long() * BLOCK + torch.arange(BLOCK) for j in range(-(-n // BLOCK))])[:n]
        keys = flat[rows, : rank + rope]
        p = torch.softmax(0.3 * q[t, :, : rank + rope] @ keys.T, dim=-1)
        assert_close(f"context {n}", p @ keys[:, :rank], out[t, :, :rank], 1e-6)
        assert torch.equal(out[t, :, rank:], torch.zeros(H, D - rank))


@pytest.mark.parametrize("H, rank, rope, D", [(8, 32, 16, 48), (3, 24, 8, 40)])
def test_triton_matches_reference_fp32(H, rank, rope, D):
    """(8, 32, 16, 48): gpu_1b's shape scaled down (8 heads padded to 16 rows, a zero pad after k_pe);
    (3, 24, 8, 40): nothing a power of two, every mask in play."""
    q, k_cache, out, starts, used, table = paged_case(H, rank, rope, D)
    want = latent_decode_naive(q, k_cache, out.clone(), starts, used, table, 0.25, rank, rope)
    got = MLA.latent_decode_triton(q, k_cache, out, starts, used, table, 0.25, rank, rope)
    assert got is out
    assert_close("out", want, got, 1e-6)
    assert torch.equal(got[:, :, rank:], torch.zeros_like(got[:, :, rank:]))


@pytest.mark.parametrize("splits, stages", [(1, None), (4, 2), (32, 4)])
def test_every_launch_shape_computes_the_same(splits, stages):
    """The launch knobs bench/mla_decode.py sweeps (splits a sequence, pipeline stages): one split takes a whole
    300-token context, 32 splits leave most of them empty."""
    H, rank, rope, D = 8, 32, 16, 48
    q, k_cache, out, starts, used, table = paged_case(H, rank, rope, D)
    want = latent_decode_naive(q, k_cache, out.clone(), starts, used, table, 0.25, rank, rope)
    got = MLA.latent_decode_triton(q, k_cache, out, starts, used, table, 0.25, rank, rope, splits=splits,
                                   stages=stages)  # fmt: skip
    assert_close("out", want, got, 1e-6)


def test_triton_matches_reference_bf16():
    H, rank, rope, D = 8, 32, 16, 48
    q, k_cache, out, starts, used, table = paged_case(H, rank, rope, D, torch.bfloat16, seed=1)
    want = latent_decode_naive(q, k_cache, out.clone(), starts, used, table, 0.25, rank, rope)
    got = MLA.latent_decode_triton(q, k_cache, out, starts, used, table, 0.25, rank, rope)
    assert_close("out", want.float(), got.float(), 1e-2)  # the probabilities meet c_kv in bf16, as vLLM's


def test_padding_entries_write_nothing():
    """A CUDA graph's padded batch: entries after the last live one repeat the final query start (here the row
    after the output, which a stray store would overwrite), with a used length and a zero page row."""
    q, k_cache, out, starts, used, table = paged_case(3, 24, 8, 40)
    T = out.shape[0]
    big = torch.full((T + 1, *out.shape[1:]), 7.0)
    big[:T] = out
    starts = torch.cat([starts, starts[-1:]])
    used = torch.cat([used, torch.tensor([5], dtype=torch.int32)])
    table = torch.cat([table, torch.zeros_like(table[:1])])
    want = latent_decode_naive(q, k_cache, big[:T].clone(), starts, used, table, 0.25, 24, 8)
    MLA.latent_decode_triton(q, k_cache, big[:T], starts, used, table, 0.25, 24, 8)
    assert_close("out", want, big[:T], 1e-6)
    assert torch.equal(big[T], torch.full_like(big[T], 7.0))


def test_bad_shapes_are_named():
    q, k_cache, out, starts, used, table = paged_case(3, 24, 8, 40)
    with pytest.raises(ValueError, match="rank \\+ rope"):
        MLA.latent_decode_triton(q, k_cache, out, starts, used, table, 0.25, 40, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        MLA.latent_decode_triton(q, k_cache, out, starts[:-1], used, table, 0.25, 24, 8)
    with pytest.raises(ValueError, match="splits must be a power of two"):
        MLA.latent_decode_triton(q, k_cache, out, starts, used, table, 0.25, 24, 8, splits=12)
