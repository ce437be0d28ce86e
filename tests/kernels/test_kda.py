"""Chunked KDA against the float64 token-by-token reference: forward, backward, varlen, dtypes."""

from __future__ import annotations

import pytest
import torch
from kda_cases import H, K, V, compare, make_inputs, run_with_grads

from kernels.kda import chunk as chunk_module
from kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kernels.kda.chunk import chunked_kda_torch
from kernels.testing import assert_close


@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_matches_reference_fwd_bwd(T, dtype):
    """The chunked algorithm at every length (chunk_kda itself sends T <= 16 to the recurrence)."""
    B = 2
    inputs = make_inputs(B, T, dtype, seed=T)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(7))
    ref = run_with_grads(naive_recurrent_kda, inputs, h0, compute_dtype=torch.float64)
    out = run_with_grads(chunked_kda_torch, inputs, h0)
    assert out["o"].dtype == dtype and out["ht"].dtype == torch.float32
    compare(ref, out, dtype, f"T={T} {dtype}")


@pytest.mark.parametrize("T", [65, 130])
def test_chunk_is_exact_in_float64(T):
    """In float64 the chunked algorithm agrees with the recurrence to rounding: it is the same math."""
    inputs = make_inputs(1, T, torch.float64, seed=3)
    h0 = torch.randn(1, H, K, V, dtype=torch.float64)
    ref = run_with_grads(naive_recurrent_kda, inputs, h0)
    out = run_with_grads(chunk_kda, inputs, h0)
    compare(ref, out, torch.float64, f"T={T} f64")


@pytest.mark.parametrize("fn", [chunk_kda, chunked_kda_torch])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_varlen_matches_reference(dtype, fn):
    """Lengths 1 and 0 next to chunk-sized ones; chunk_kda mixes recurrence and chunks here."""
    lengths = [1, 63, 0, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = make_inputs(1, sum(lengths), dtype, seed=11)
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(5))
    ref = run_with_grads(naive_recurrent_kda, inputs, h0, cu, compute_dtype=torch.float64)
    out = run_with_grads(fn, inputs, h0, cu)
    compare(ref, out, dtype, f"varlen {dtype} {fn.__name__}")


def test_varlen_has_no_state_leak():
    """Packed == each sequence alone: nothing crosses a cu_seqlens boundary, forward or backward."""
    lengths = [70, 5, 64]
    cu = torch.tensor([0, 70, 75, 139])
    inputs = make_inputs(1, 139, torch.float32, seed=2)
    packed, _ = chunk_kda(**inputs, cu_seqlens=cu)
    for i, n in enumerate(lengths):
        alone = {name: x[:, cu[i] : cu[i] + n] for name, x in inputs.items()}
        o, _ = chunk_kda(**alone)
        assert_close(f"sequence {i} alone", o, packed[:, cu[i] : cu[i] + n], 1e-6)


def test_batch_equals_varlen_and_defaults():
    """B > 1 equals the same rows packed; without initial state it starts from zeros; no state unless asked."""
    inputs = make_inputs(3, 40, torch.float32, seed=4)
    o_b, ht_none = chunk_kda(**inputs)
    assert ht_none is None
    packed = {n: x.reshape(1, 120, *x.shape[2:]) for n, x in inputs.items()}
    o_p, ht_p = chunk_kda(**packed, cu_seqlens=torch.tensor([0, 40, 80, 120]), output_final_state=True)
    assert_close("batch vs packed", o_p.reshape(3, 40, H, V), o_b, 1e-6)
    _, ht_ref = naive_recurrent_kda(**inputs, output_final_state=True)
    assert_close("final state from zeros", ht_ref, ht_p, 1e-5)


def test_custom_scale():
    inputs = make_inputs(1, 70, torch.float32, seed=8)
    ref, _ = naive_recurrent_kda(**{n: x.double() for n, x in inputs.items()}, scale=0.3)
    out, _ = chunk_kda(**inputs, scale=0.3)
    assert_close("scale=0.3", ref, out, 1e-5)


def test_bad_shapes_raise():
    inputs = make_inputs(1, 10, torch.float32)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(**{**inputs, "beta": inputs["beta"][..., :1]})
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(**inputs, initial_state=torch.zeros(2, H, K, V))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(**inputs, cu_seqlens=torch.tensor([0, 4]))


@pytest.mark.parametrize("fn", [chunk_kda, chunked_kda_torch, fused_recurrent_kda])
def test_empty_sequences_pass_the_state_through(fn):
    """T = 0 (all sequences empty): empty output, final state == initial state (or zeros)."""
    x = make_inputs(1, 0, torch.float32)
    h0 = torch.randn(2, H, K, V)
    o, ht = fn(**x, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor([0, 0, 0]))
    assert o.shape == (1, 0, H, V) and torch.equal(ht, h0)
    o, ht = fn(**make_inputs(2, 0, torch.float32), output_final_state=True)
    assert o.shape == (2, 0, H, V) and torch.equal(ht, torch.zeros(2, H, K, V))


def test_short_sequences_take_the_recurrence(monkeypatch):
    """Decode-like batches (every sequence <= RECURRENT_MAX_LEN) never build a chunk; mixed
    batches split, and both agree with the reference forward and backward."""
    lengths = [1, 3, 16, 17, 100, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = make_inputs(1, sum(lengths), torch.float32, seed=12)
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(8))
    ref = run_with_grads(naive_recurrent_kda, inputs, h0, cu, compute_dtype=torch.float64)
    compare(ref, run_with_grads(chunk_kda, inputs, h0, cu), torch.float32, "mixed lengths")
    calls = []
    real = chunk_module.chunked_kda_torch
    monkeypatch.setattr(chunk_module, "chunked_kda_torch", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    decode = {n: x[:, :4] for n, x in inputs.items()}
    o, _ = chunk_kda(**decode, cu_seqlens=torch.tensor([0, 1, 2, 3, 4]))
    assert not calls, "single-token sequences should not be padded into chunks"
    o_ref, _ = naive_recurrent_kda(
        **{n: x.double() for n, x in decode.items()}, cu_seqlens=torch.tensor([0, 1, 2, 3, 4])
    )
    assert_close("decode batch", o_ref, o, 1e-5)
    chunk_kda(**inputs, cu_seqlens=cu)
    assert len(calls) == 1 and calls[0][0].shape[1] == 117, "only the two long sequences go through chunks"
