"""kernels.moe: route layout invariants, permute/unpermute, grouped_mm (torch and loop) vs per-slot products."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import grouped_mm, grouped_mm_backend, permute, route_layout, unpermute
from kernels.moe.naive import grouped_mm_naive
from kernels.testing import assert_close, import_interpreted


def _routing(T, k, E, seed=0, skip=()):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    for e in skip:  # experts that get no token
        experts[experts == e] = (e + 1) % E
    return experts


@pytest.mark.parametrize("align", [1, 4, 8])
def test_route_layout_sorts_slots_by_expert_and_pads_groups(align):
    T, k, E = 37, 3, 8
    experts = _routing(T, k, E, skip=(2,))
    lay = route_layout(experts, E, align)
    counts = torch.bincount(experts.reshape(-1), minlength=E)
    padded = (counts + align - 1) // align * align
    assert torch.equal(lay.offs_E.long(), padded.cumsum(0))
    assert lay.offs_E.dtype == torch.int32 and lay.rows == T * k + E * (align - 1)
    starts = padded.cumsum(0) - padded
    rows = lay.row_of_slot_S.view(T, k)
    for t in range(T):
        for j in range(k):
            e, r = int(experts[t, j]), int(rows[t, j])
            assert starts[e] <= r < starts[e] + counts[e]  # inside its expert's group, not in padding
            assert int(lay.src_row_P[r]) == t
    assert len(set(lay.row_of_slot_S.tolist())) == T * k  # every slot its own row
    used = torch.zeros(lay.rows, dtype=torch.bool)
    used[lay.row_of_slot_S] = True
    assert bool((lay.src_row_P[~used] == T).all())  # padding and tail rows read the zero row
    # stable: within an expert, slots keep token order
    for e in range(E):
        mine = rows[experts == e]
        assert torch.equal(mine, mine.sort().values)


@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
@pytest.mark.parametrize("align", [1, 8])
def test_grouped_mm_round_trip_equals_per_slot_products_fwd_bwd(dtype, ratio, align):
    T, k, E, Z, N = 29, 2, 6, 16, 24
    experts = _routing(T, k, E, seed=1, skip=(4,))
    lay = route_layout(experts, E, align)
    z = torch.randn(T, Z, dtype=dtype, requires_grad=True)
    w = torch.randn(E, N, Z, dtype=dtype, requires_grad=True)
    expected = "torch" if dtype == torch.float32 else "naive"
    assert grouped_mm_backend(permute(z, lay), w) == expected
    y = unpermute(grouped_mm(permute(z, lay), w, lay.offs_E), lay)
    ref = torch.stack([torch.stack([z[t] @ w[experts[t, j]].T for j in range(k)]) for t in range(T)])
    assert_close("y", ref, y, ratio)
    gy = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, (z, w), gy), torch.autograd.grad(ref, (z, w), gy)
    assert_close("dz", want[0], got[0], ratio * 10)
    assert_close("dw", want[1], got[1], ratio * 10)
    assert float(got[1][4].abs().max()) == 0.0  # the idle expert gets a zero gradient


def test_torch_grouped_mm_equals_the_loop_and_sum_backward_works():
    x = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    offs = torch.tensor([5, 5, 20], dtype=torch.int32)
    y = grouped_mm(x, w, offs)
    assert_close("y", grouped_mm_naive(x, w, offs), y, 1e-6)
    y.sum().backward()  # a zero-stride gradient: torch's CPU backward needs it made contiguous
    assert x.grad.shape == x.shape and float(w.grad[1].abs().max()) == 0.0


def test_unaligned_or_float64_take_the_loop_and_bad_shapes_are_named():
    assert grouped_mm_backend(torch.randn(4, 6), torch.randn(2, 8, 6)) == "naive"  # 24-byte rows
    assert grouped_mm_backend(torch.randn(4, 8).double(), torch.randn(2, 8, 8).double()) == "naive"
    with pytest.raises(ValueError, match="w \\[G, N, K\\]"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 6), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="one end per group"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([4], dtype=torch.int32))


def _interpreted_triton_module():
    pytest.importorskip("triton")
    return import_interpreted("kernels.moe.triton")[0]


@pytest.mark.parametrize("N, K", [(64, 32), (40, 24)])  # one tile; partial tiles in both dims
def test_triton_grouped_mm_matches_the_loop_fwd_bwd(monkeypatch, N, K):
    """Under TRITON_INTERPRET=1: groups empty, shorter and longer than a 64-row tile, a tail past offs[-1]."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    offs = torch.tensor([0, 5, 5, 75, 140], dtype=torch.int32)
    x = torch.randn(150, K, requires_grad=True)
    w = torch.randn(5, N, K, requires_grad=True)
    group, first = mod._tile_schedule(offs, 64, 150 // 64 + 1 + 5)
    assert group.tolist() == [1, 3, 3, 4, 4, 5, 5, 5]  # tiles of groups 1, 3, 3, 4, 4, then spares (= G)
    assert first.tolist()[:5] == [0, 5, 69, 75, 139]
    y = mod.grouped_mm_triton(x, w, offs)
    ref = grouped_mm_naive(x, w, offs)
    assert_close("y", ref, y, 1e-6)
    assert float(y[140:].abs().max()) == 0.0
    dy = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)
    assert_close("dx", want[0], got[0], 1e-6)
    assert_close("dw", want[1], got[1], 1e-6)
