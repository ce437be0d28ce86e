"""Decode paths: fused_recurrent_kda and the in-place pool step against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kda_cases import TOL, H, K, V, compare, make_inputs, run_with_grads

from kernels.kda import chunk_kda, fused_recurrent_kda, kda_decode_step_, naive_recurrent_kda
from kernels.testing import assert_close


def f64(inputs):
    return {n: x.double() for n, x in inputs.items()}


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_recurrent_matches_reference(T, dtype):
    inputs = make_inputs(2, T, dtype, seed=20 + T)
    h0 = torch.randn(2, H, K, V, generator=torch.Generator().manual_seed(3))
    ref = run_with_grads(naive_recurrent_kda, inputs, h0, compute_dtype=torch.float64)
    out = run_with_grads(fused_recurrent_kda, inputs, h0)
    compare(ref, out, dtype, f"fused T={T} {dtype}")


def test_fused_recurrent_varlen():
    lengths = [3, 0, 1, 5]
    cu = torch.tensor([0, 3, 3, 4, 9])
    inputs = make_inputs(1, sum(lengths), torch.float32, seed=9)
    h0 = torch.randn(4, H, K, V)
    o_ref, ht_ref = naive_recurrent_kda(
        **f64(inputs), initial_state=h0.double(), output_final_state=True, cu_seqlens=cu
    )
    o, ht = fused_recurrent_kda(**inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close("fused varlen o", o_ref, o, TOL[torch.float32]["o"])
    assert_close("fused varlen ht", ht_ref, ht, TOL[torch.float32]["ht"])


def test_prefill_then_decode_equals_full_sequence():
    """chunk_kda over a prompt, then fused_recurrent token by token == the reference over all of it."""
    T0, T1 = 70, 4
    inputs = make_inputs(2, T0 + T1, torch.float32, seed=13)
    o_ref, ht_ref = naive_recurrent_kda(**f64(inputs), output_final_state=True)
    head = {n: x[:, :T0] for n, x in inputs.items()}
    o_pre, state = chunk_kda(**head, output_final_state=True)
    outs = [o_pre]
    for t in range(T0, T0 + T1):
        step = {n: x[:, t : t + 1] for n, x in inputs.items()}
        o_t, state = fused_recurrent_kda(**step, initial_state=state, output_final_state=True)
        outs.append(o_t)
    assert_close("prefill+decode o", o_ref, torch.cat(outs, dim=1), 1e-5)
    assert_close("prefill+decode state", ht_ref, state, 1e-5)


def test_pool_decode_in_place():
    """Three sequences in slots [4, 0, 2] of a 6-slot pool plus one padding entry, decoded one token a step."""
    P, steps = 6, 5
    slots = [4, 0, 2]
    seqs = [make_inputs(1, steps, torch.float32, seed=30 + i) for i in range(3)]
    h0 = torch.randn(3, H, K, V, generator=torch.Generator().manual_seed(4))
    pool = torch.randn(P, H, K, V, generator=torch.Generator().manual_seed(5))
    pool[slots] = h0
    untouched = pool[[1, 3, 5]].clone()
    indices = torch.tensor([*slots, -1], dtype=torch.int32)
    outs = []
    for t in range(steps):
        # [N, H, K] form: one token per sequence, the padding row gets copies of row 0.
        step = {n: torch.cat([s[n][0, t][None] for s in [*seqs, seqs[0]]]) for n in seqs[0]}
        o = kda_decode_step_(**step, state_pool=pool, state_indices=indices)
        assert o.shape == (4, H, V)
        assert torch.equal(o[3], torch.zeros(H, V)), "padding entry must produce zeros"
        outs.append(o[:3])
    for i, s in enumerate(seqs):
        o_ref, ht_ref = naive_recurrent_kda(
            **f64(s), initial_state=h0[i : i + 1].double(), output_final_state=True
        )
        o_dec = torch.stack([o[i] for o in outs])
        assert_close(f"pool seq {i} o", o_ref[0], o_dec, 1e-5)
        assert_close(f"pool seq {i} state", ht_ref[0], pool[slots[i]], 1e-5)
    assert torch.equal(pool[[1, 3, 5]], untouched), "slots not named must be left alone"


def test_pool_decode_multi_token_and_errors():
    inputs = make_inputs(2, 3, torch.float32, seed=40)
    pool = torch.zeros(3, H, K, V)
    o = kda_decode_step_(**inputs, state_pool=pool, state_indices=torch.tensor([2, 0]))
    o_ref, ht_ref = naive_recurrent_kda(**f64(inputs), output_final_state=True)
    assert_close("multi-token o", o_ref, o, 1e-5)
    assert_close("multi-token states", ht_ref, pool[[2, 0]], 1e-5)
    with pytest.raises(ValueError, match="twice"):
        kda_decode_step_(**inputs, state_pool=pool, state_indices=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="out of range"):
        kda_decode_step_(**inputs, state_pool=pool, state_indices=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="state_pool"):
        kda_decode_step_(**inputs, state_pool=torch.zeros(3, H, K, V + 1), state_indices=torch.tensor([0, 1]))


def _one_token_step(seed: int, N: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta of one decode token for N sequences (k unit-norm, g < 0) and a pool of 6 states."""
    gen = torch.Generator().manual_seed(seed)
    q, k, g = (torch.randn(N, H, K, generator=gen) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    g = -torch.rand(N, H, K, generator=gen)
    v, beta = torch.randn(N, H, V, generator=gen), torch.rand(N, H, generator=gen)
    return q, k, v, g, beta, torch.randn(6, H, K, V, generator=gen) * 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_decode_one_token_fast_path_equals_generic_path(dtype):
    """One token and no padding entry takes a direct step; a padding entry forces the generic path.
    The live sequences' outputs and slots must agree bit for bit."""
    N = 3
    q, k, v, g, beta, pool = _one_token_step(11, N)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    slots = torch.tensor([4, 0, 2])
    fast_pool, generic_pool = pool.clone(), pool.clone()
    o_fast = kda_decode_step_(q, k, v, g, beta, fast_pool, slots)
    pad = lambda x: torch.cat([x, x[:1]])
    o_generic = kda_decode_step_(
        pad(q), pad(k), pad(v), pad(g), pad(beta), generic_pool, torch.cat([slots, torch.tensor([-1])])
    )
    assert torch.equal(o_fast, o_generic[:N])
    assert torch.equal(fast_pool, generic_pool)
    assert torch.equal(fast_pool[[1, 3, 5]], pool[[1, 3, 5]])


def test_pool_decode_output_in_the_asked_dtype_is_the_rounded_output():
    """``out_dtype``: o comes back in that dtype, equal to the default output rounded to it, on both the
    one-token path and the generic (padded) one; the states are what they are without it."""
    q, k, v, g, beta, pool = _one_token_step(5, 3)
    for slots in (torch.tensor([4, 0, 2]), torch.tensor([4, -1, 2])):  # the direct step, then the generic path
        ref_pool, got_pool = pool.clone(), pool.clone()
        ref = kda_decode_step_(q, k, v, g, beta, ref_pool, slots)
        got = kda_decode_step_(q, k, v, g, beta, got_pool, slots, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref.to(torch.bfloat16))
        assert torch.equal(got_pool, ref_pool)
