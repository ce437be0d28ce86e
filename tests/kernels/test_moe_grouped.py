"""kernels.moe: route layout invariants, permute/unpermute, grouped_mm (torch and loop) vs per-slot products, and
the two expert nodes of the grouped MoE (permute_grouped_mm, glu_grouped_mm_combine) vs the ops they fuse."""

from __future__ import annotations

import pytest
import torch

import kernels.moe as moe_kernels
from kernels.glu import GluActivation, situ_glu_reference
from kernels.moe import (
    combine,
    glu_grouped_mm_combine,
    grouped_mm,
    grouped_mm_backend,
    grouped_mm_dw,
    grouped_mm_dx,
    permute,
    permute_grouped_mm,
    route_layout,
    unpermute,
)
from kernels.moe.naive import grouped_mm_naive
from kernels.testing import assert_close, assert_within_ulps, error_ratio, import_interpreted
from model.moe import select_experts


def _routing(T, k, E, seed=0, skip=()):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    for e in skip:  # experts that get no token
        experts[experts == e] = (e + 1) % E
    return experts


@pytest.mark.parametrize("ranks", ["count", "sort"])
@pytest.mark.parametrize("align", [1, 4, 8])
def test_route_layout_sorts_slots_by_expert_and_pads_groups(align, ranks, monkeypatch):
    monkeypatch.setattr(moe_kernels, "COUNTING_LAYOUT_MAX", 1 << 30 if ranks == "count" else 0)
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


@pytest.mark.parametrize("T, k, E", [(1, 1, 4), (1, 8, 128), (64, 8, 128), (300, 2, 16), (1000, 8, 128)])
def test_counting_and_sorting_layouts_are_the_same_integers(T, k, E):
    """Both rankings of ``route_tensors``: the decode steps' counting one and the learner's stable sort."""
    gen = torch.Generator().manual_seed(T * k + E)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    experts[experts == 3] = 0  # an expert nobody picks (a token may then name 0 twice: the layout does not care)
    flat = experts.reshape(-1)
    by_count, by_sort = moe_kernels._ranks_by_count(flat, E), moe_kernels._ranks_by_sort(flat, E)
    assert all(torch.equal(a, b) for a, b in zip(by_count, by_sort, strict=True))
    assert by_count[1].sum() == T * k and by_count[1][3] == 0


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


def test_a_named_backend_is_run_or_refused(monkeypatch):
    """``LONGHORIZON_GROUPED_MM`` (``GROUPED_MM``) names the backend: the named one runs where it can take the
    operands, a clear error where it cannot or where the name is unknown."""
    import kernels.moe as moe_kernels

    x, w = torch.randn(20, 16), torch.randn(3, 8, 16)
    offs = torch.tensor([5, 5, 20], dtype=torch.int32)
    monkeypatch.setattr(moe_kernels, "GROUPED_MM", "naive")
    assert grouped_mm_backend(x, w) == "naive"
    assert_close("y", grouped_mm_naive(x, w, offs), grouped_mm(x, w, offs), 1e-6)
    monkeypatch.setattr(moe_kernels, "GROUPED_MM", "triton")
    with pytest.raises(ValueError, match=r"LONGHORIZON_GROUPED_MM=triton cannot run torch\.float32 operands on cpu"):
        grouped_mm(x, w, offs)
    monkeypatch.setattr(moe_kernels, "GROUPED_MM", "cutlass")
    with pytest.raises(ValueError, match="must be one of"):
        grouped_mm_backend(x, w)


def test_unaligned_or_float64_take_the_loop_and_bad_shapes_are_named():
    assert grouped_mm_backend(torch.randn(4, 6), torch.randn(2, 8, 6)) == "naive"  # 24-byte rows
    assert grouped_mm_backend(torch.randn(4, 8).double(), torch.randn(2, 8, 8).double()) == "naive"
    with pytest.raises(ValueError, match="w \\[G, N, K\\]"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 6), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="one end per group"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([4], dtype=torch.int32))


def _interpreted_triton_module():
    pytest.importorskip("triton")
    return import_interpreted("kernels.glu.jit", "kernels.moe.triton")[1]  # its SiTU epilogue is glu's


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


@pytest.mark.parametrize("N, K", [(64, 64), (40, 24)])  # one tile; partial tiles in both dims
@pytest.mark.parametrize("tiles", [None, (16, 32, 128), (32, 128, 16), (32, 64, 64)])  # by rows; other (BM, BN, BK)
def test_small_grouped_mm_matches_the_loop(monkeypatch, N, K, tiles):
    """The decode step's kernel under TRITON_INTERPRET=1: groups empty, of one row, longer than its row tile
    (several tiles), the weight a strided view, rows past offs[-1] never computed; with the default launch and
    the tile shapes bench/grouped_mm_decode.py --sweep tries (narrower and wider than the matrices)."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    offs = torch.tensor([0, 1, 1, 40, 47], dtype=torch.int32)
    x = torch.randn(52, K)
    w = torch.randn(5, K, N).transpose(1, 2)  # [G, N, K], not contiguous
    y = mod.grouped_mm_small(x, w, offs, None if tiles is None else mod.SmallTiles(*tiles))
    assert_close("y", grouped_mm_naive(x, w, offs)[:47], y[:47], 1e-6)


def test_small_grouped_mm_launch_by_rows():
    """The decode kernel's launch follows its row count (the sweep's table): the default up to 1,023 rows, two
    pipeline stages up to 2,559, then 32-row tiles; every entry a launch the loop test above holds to the loop."""
    mod = _interpreted_triton_module()
    assert mod.small_tiles(960) == mod.SmallTiles() and mod.small_tiles(1023) == mod.SmallTiles()
    assert mod.small_tiles(1024) == mod.small_tiles(2559) == mod.SmallTiles(stages=2)
    assert mod.small_tiles(2560) == mod.small_tiles(10**6) == mod.SmallTiles(bm=32)


def test_grouped_mm_forward_picks_its_kernel_by_rows(monkeypatch):
    """The custom op runs the small-rows kernel up to SMALL_ROWS_MAX rows and torch's kernel above, both equal to
    the loop; ``torch.library.opcheck`` holds its fake to the real output and runs it under AOT autograd with
    dynamic shapes (what a compiled MoE block does with it)."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    small = mod.grouped_mm_small
    monkeypatch.setattr(mod, "grouped_mm_small", lambda *a: calls.append(a[0].shape[0]) or small(*a))
    offs = torch.tensor([8, 8, 24, 32], dtype=torch.int32)
    x, w = torch.randn(32, 16), torch.randn(4, 8, 16)
    want = grouped_mm_naive(x, w, offs)
    for limit, used_small in ((32, True), (31, False)):
        monkeypatch.setattr(mod, "SMALL_ROWS_MAX", limit)
        calls.clear()
        assert_close(f"y (rows limit {limit})", want, mod.grouped_mm_forward(x, w, offs), 1e-6)
        assert calls == ([32] if used_small else [])
    torch.library.opcheck(mod.grouped_mm_forward, (x, w, offs))  # schema, fake, autograd registration, AOT dynamic


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_scale_rows_equals_the_mixed_dtype_mul(monkeypatch, dtype):
    """The MoE backward's row scaling: fp32 weights times the rows in fp32, rounded once, as ``mul_`` does (a
    strided view with a contiguous last dim, a width over one column block, a partial row block). fp32:
    bit for bit; bf16 within one unit of the last place (the interpreter rounds a bf16 store toward zero,
    a GPU to nearest)."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    base = torch.randn(19, 300).to(dtype)
    before = base.clone()
    x, w = base[:, :260], torch.randn(19, 1)
    want = x.clone().mul_(w)
    got = mod.scale_rows_triton_(x, w[:, 0])
    assert got.data_ptr() == base.data_ptr()
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert_within_ulps("scaled rows", want, got, 1)
    assert torch.equal(base[:, 260:], before[:, 260:])  # the columns past the view untouched
    with pytest.raises(ValueError, match="scale_rows"):
        mod.scale_rows_triton_(torch.randn(4, 6).t(), torch.randn(6))


# ------------------------------------------------------------------------------------------ the expert nodes
@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_grouped_mm_gradient_products_equal_autograd(dtype, ratio):
    """grouped_mm_dx / grouped_mm_dw, the products the expert nodes call, as grouped_mm's own backward gives
    them: an empty group, a tail past offs[-1] (its dx rows are not defined on the torch path)."""
    x = torch.randn(22, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(3, 8, 16, dtype=dtype, requires_grad=True)
    offs = torch.tensor([5, 5, 18], dtype=torch.int32)
    backend = grouped_mm_backend(x, w)
    assert backend == ("torch" if dtype == torch.float32 else "naive")
    dy = torch.randn(22, 8, dtype=dtype)
    want_dx, want_dw = torch.autograd.grad(grouped_mm(x, w, offs), (x, w), dy)
    assert_close("dx", want_dx[:18], grouped_mm_dx(dy, w.detach(), offs, backend)[:18], ratio)
    dw = grouped_mm_dw(dy, x.detach(), offs, backend)
    assert_close("dw", want_dw, dw, ratio)
    assert float(dw[1].abs().max()) == 0.0


def _experts_composed(z, lay, w_gu, w_down, weights, dt):
    """What the two nodes replace: permute, grouped_mm, SiTU-GLU, grouped_mm, combine (weights cast outside)."""
    gu = grouped_mm(permute(z, lay), w_gu.to(dt), lay.offs_E)
    h = situ_glu_reference(*gu.chunk(2, dim=-1))
    return combine(grouped_mm(h, w_down.to(dt), lay.offs_E), lay, weights, z.dtype)


def _experts_fused(z, lay, w_gu, w_down, weights, dt):
    gu = permute_grouped_mm(z, lay, w_gu)
    return glu_grouped_mm_combine(gu, lay, w_down, weights, GluActivation(), z.dtype)


def _expert_case(dtype, align, seed=2):
    T, k, E, Z, I = 61, 3, 8, 16, 24
    lay = route_layout(_routing(T, k, E, seed=seed, skip=(5,)), E, align)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, Z, generator=g, dtype=torch.float64).to(dtype)
    master = torch.float64 if dtype == torch.float64 else torch.float32
    w_gu = (torch.randn(E, 2 * I, Z, generator=g, dtype=torch.float64) / 4).to(master)
    w_down = (torch.randn(E, Z, I, generator=g, dtype=torch.float64) / 5).to(master)
    weights = torch.rand(T, k, generator=g, dtype=torch.float64).to(master)
    leaves = [t.requires_grad_() for t in (z, w_gu, w_down, weights)]
    return lay, leaves, torch.randn(T, Z, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("dtype, align, ratio", [(torch.float32, 1, 1e-6), (torch.float32, 8, 1e-6),
                                                 (torch.float64, 8, 1e-13)])  # fmt: skip
def test_expert_nodes_equal_the_composition_fwd_bwd(dtype, align, ratio):
    """permute_grouped_mm + glu_grouped_mm_combine against the ops they fuse: padding rows (align 8), an idle
    expert; fp32 on torch's grouped GEMM, float64 on the loop. The forward runs the same ops (bit for bit),
    the gradients differ by fp32 rounding (dh rounds dy W before the routing weight, not after)."""
    lay, (z, w_gu, w_down, weights), gy = _expert_case(dtype, align)
    outs = {}
    for name, fn in (("composed", _experts_composed), ("fused", _experts_fused)):
        y = fn(z, lay, w_gu, w_down, weights, dtype)
        outs[name] = (y, torch.autograd.grad(y, (z, w_gu, w_down, weights), gy.to(dtype)))
    (y_ref, g_ref), (y, g) = outs["composed"], outs["fused"]
    assert torch.equal(y, y_ref)
    for name, a, b in zip(("dz", "dw_gu", "dw_down", "dweights"), g_ref, g):
        assert_close(name, a, b, ratio * 10)
    assert float(g[1][5].abs().max()) == float(g[2][5].abs().max()) == 0.0  # the idle expert


def test_expert_nodes_in_bf16_are_as_accurate_as_the_composition():
    """bf16 rows with fp32 master weights (the learner under autocast): the same forward bit for bit, every
    gradient as close to the float64 result as the composition's (the weights' gradients arrive in fp32)."""
    lay, leaves, gy = _expert_case(torch.float64, 8, seed=3)
    results = {}
    for name, fn, dt in (("exact", _experts_composed, torch.float64), ("composed", _experts_composed, torch.bfloat16),
                         ("fused", _experts_fused, torch.bfloat16)):  # fmt: skip
        z = leaves[0].detach().to(dt).requires_grad_()
        ws = [
            t.detach().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
            for t in leaves[1:]
        ]
        y = fn(z, lay, *ws, dt)
        results[name] = [y, *torch.autograd.grad(y, (z, *ws), gy.to(dt))]
    assert torch.equal(results["fused"][0], results["composed"][0])
    assert [t.dtype for t in results["fused"][2:]] == [torch.float32] * 3
    for name, exact, old, new in zip(("y", "dz", "dw_gu", "dw_down", "dweights"), *results.values()):
        err_old, err_new = error_ratio(exact, old), error_ratio(exact, new)
        assert err_new <= 1.25 * err_old + 1e-4, f"{name}: fused {err_new:.2e} vs composed {err_old:.2e}"


def test_expert_nodes_keep_only_z_the_gate_up_rows_and_the_weights():
    """Saved for backward (distinct storages, the master weights left out: they are alive anyway): the fused
    nodes keep z (with its zero row), the gate/up rows and the routing weights; the composition also keeps
    the permuted rows, h, the gathered down-projected rows and bf16 copies of the weights."""
    lay, (z, w_gu, w_down, weights), _ = _expert_case(torch.float32, 8)
    z, params = (
        z.detach().bfloat16().requires_grad_(),
        {t.untyped_storage().data_ptr() for t in (w_gu, w_down)},
    )
    kept = {}
    for name, fn in (("composed", _experts_composed), ("fused", _experts_fused)):
        seen: dict[int, int] = {}

        def pack(t, seen=seen):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen.setdefault(st.data_ptr(), st.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(z, lay, w_gu, w_down, weights, torch.bfloat16)
        kept[name] = sum(seen.values())
    P, (T, Z), I = lay.rows, z.shape, w_down.shape[2]
    assert kept["fused"] == (T + 1) * Z * 2 + P * 2 * I * 2 + weights.numel() * 4
    assert kept["composed"] >= kept["fused"] + P * Z * 2 + P * I * 2 + T * lay.top_k * Z * 2


def test_expert_nodes_on_the_triton_grouped_mm_equal_the_loop(monkeypatch):
    """The nodes' gradient products through the Triton kernels (the fp32 / fp16 CUDA path; interpreted)."""
    import kernels.moe as moe

    _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lay, (z, w_gu, w_down, weights), gy = _expert_case(torch.float32, 8)
    leaves = (z, w_gu, w_down, weights)
    outs = {}
    for backend in ("naive", "triton"):
        monkeypatch.setattr(moe, "grouped_mm_backend", lambda x, w, b=backend: b)
        y = _experts_fused(z, lay, w_gu, w_down, weights, torch.float32)
        outs[backend] = (y, torch.autograd.grad(y, leaves, gy.float()))
    for name, a, b in zip(("y", "dz", "dw_gu", "dw_down", "dweights"), [outs["naive"][0], *outs["naive"][1]],
                          [outs["triton"][0], *outs["triton"][1]]):  # fmt: skip
        assert_close(name, a, b, 1e-5)


def _skewed_routing(T: int, k: int, E: int, skew: bool) -> torch.Tensor:
    """``_routing``; ``skew``: every token's first slot on expert 3 (ranks past a tile)."""
    experts = _routing(T, k, E, seed=T * 31 + E)
    if skew:
        experts[:, 0] = 3
    return experts


def _assert_layout_equal_up_to_group_order(got, experts: torch.Tensor, E: int, align: int) -> None:
    """``got`` (src_row_P, row_of_slot_S, offs_E) against ``route_tensors``: the same dtypes, shapes, group ends
    and padding rows (T), every slot in its expert's group on a row that reads its token, each group the same
    tokens (its rows in any order), and the grouped product and combine through it equal, bit for bit."""
    T, k = experts.shape
    want = moe_kernels.route_tensors(experts, E, align)
    assert all(g.dtype == w.dtype and g.shape == w.shape for g, w in zip(got, want, strict=True))
    (src, rows, offs), (want_src, _, want_offs) = got, want
    assert torch.equal(offs, want_offs)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
    slot_ex = experts.reshape(-1)
    assert bool(((rows >= starts[slot_ex]) & (rows < offs.long()[slot_ex])).all())  # in its expert's group
    assert torch.equal(src[rows], torch.arange(T * k) // k)  # the row reads its slot's token
    for e in range(E):
        group = slice(int(starts[e]), int(offs[e]))
        assert torch.equal(src[group].sort().values, want_src[group].sort().values)
    assert bool((src[int(offs[-1]) :] == T).all())
    z, w = torch.randn(T, 16), torch.randn(E, 8, 16)
    lay = lambda t: moe_kernels.RouteLayout(*t, T, k)
    ys = [moe_kernels.combine(grouped_mm_naive(moe_kernels.permute(z, lay(t)), w, t[2]), lay(t), torch.ones(T, k))
          for t in (want, got)]  # fmt: skip
    assert torch.equal(*ys)


@pytest.mark.parametrize(
    "T, k, E, align, skew",
    [(64, 8, 128, 8, False),  # a decode step of gpu_1b: 512 slots, 8 tiles of 64
     (3, 2, 5, 1, False),  # no padding, E not a power of two
     (65, 8, 16, 16, True),  # one expert takes most slots (ranks past a tile), groups padded to 16
     (1, 1, 4, 4, False)],  # one slot
)  # fmt: skip
def test_route_tensors_small_equal_the_torch_layout_up_to_the_order_inside_groups(monkeypatch, T, k, E, align, skew):
    """The engine's two-launch route layout under TRITON_INTERPRET=1 against ``route_tensors``
    (``_assert_layout_equal_up_to_group_order``: the ranks come from atomic adds); twice in a row (the counts left
    at zero)."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    experts = _skewed_routing(T, k, E, skew)
    for _ in range(2):
        _assert_layout_equal_up_to_group_order(mod.route_tensors_small(experts, E, align), experts, E, align)


@pytest.mark.parametrize(
    "T, k, E, align, skew",
    [(300, 8, 128, 8, False),  # past ROUTE_SMALL_MAX: 2,400 slots, three programs of 1,024, gpu_1b's experts
     (200, 8, 20, 1, True),  # no padding, E not a power of two, one expert in every token
     (130, 8, 16, 16, False),  # groups padded to 16: tail rows past the last group
     (129, 8, 128, 8, True),  # 1,032 slots: just past the small layout's limit, one expert in every token
     (2, 2, 5, 4, False)],  # fewer slots than a program
)  # fmt: skip
def test_route_tensors_large_equal_the_torch_layout_up_to_the_order_inside_groups(monkeypatch, T, k, E, align, skew):
    """The engine's three-launch route layout for prefill steps under TRITON_INTERPRET=1 against ``route_tensors``
    (``_assert_layout_equal_up_to_group_order``); twice in a row (the counts left at zero), the rows poisoned
    before the second (every row written: the slots', the groups' padding and the tail), and after a small
    layout on the same scratch counts."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    experts = _skewed_routing(T, k, E, skew)
    torch_empty = torch.empty
    poisoned = lambda *a, **kw: torch_empty(*a, **kw).fill_(-7)
    for poison in (False, True):
        monkeypatch.setattr(mod.torch, "empty", poisoned if poison else torch_empty)
        got = mod.route_tensors_large(experts, E, align)
        monkeypatch.setattr(mod.torch, "empty", torch_empty)
        _assert_layout_equal_up_to_group_order(got, experts, E, align)
    small = _skewed_routing(4, 2, E, False)
    _assert_layout_equal_up_to_group_order(mod.route_tensors_small(small, E, align), small, E, align)
    _assert_layout_equal_up_to_group_order(mod.route_tensors_large(experts, E, align), experts, E, align)
    with pytest.raises(ValueError, match="route_tensors_large"):
        mod.route_tensors_large(experts, E, 0)


def test_route_tensors_small_refuses_a_prefill_size_and_the_engine_op_takes_torch_there(monkeypatch):
    """Past ``ROUTE_SMALL_MAX`` slots the kernel refuses, and the engine's op lays out by sort (here on CPU, where
    it always does): equal to ``route_tensors``; its fake agrees with it under ``torch.library.opcheck``."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    experts = torch.randint(0, 128, (mod.ROUTE_SMALL_MAX // 8 + 1, 8))
    with pytest.raises(ValueError, match="at most"):
        mod.route_tensors_small(experts, 128, 8)
    want = moe_kernels.route_tensors(experts, 128, 8)
    got = mod.route_tensors_engine(experts, 128, 8, 0)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    torch.library.opcheck(mod.route_tensors_engine, (experts[:4], 128, 8, 0))


# gpu_1b's decode; E not a power of 2; n = E; more rows than a decode step (a prefill step's: the engine's op takes it)
@pytest.mark.parametrize("T, E, n", [(64, 128, 8), (5, 20, 3), (3, 7, 7), (1100, 8, 2)])
def test_top_experts_small_equal_the_sort(monkeypatch, T, E, n):
    """The engine's one-launch top-k under TRITON_INTERPRET=1: the values, experts and order of ``top_experts``
    (a stable descending sort's first n), with ties (to the lower expert) and -inf scores (group-limited routers)
    among them; a strided row read as it is."""
    from model.moe import top_experts

    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(T + E)
    scores = torch.randn(T, E + 3)[:, :E]  # rows strided
    scores[0, : E // 2] = 0.5  # half a row tied
    scores[1 % T, 1::2] = -float("inf")  # every other expert masked out
    scores[2 % T] = -float("inf")  # a whole row masked: the lowest experts, in order
    want_v, want_i = top_experts(scores, n)
    got_v, got_i = mod.top_experts_small(scores, n)
    assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)


def test_top_experts_small_refuses_what_it_does_not_take_and_the_engine_op_sorts_there(monkeypatch):
    """bf16 scores, too many experts or n past E are a ValueError; the engine's op sorts them (as on CPU, always):
    equal to ``top_experts``; its fake agrees under ``torch.library.opcheck``."""
    from model.moe import top_experts

    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    scores = torch.randn(4, 16)
    for bad, n in ((scores.bfloat16(), 2), (torch.randn(2, mod.TOP_SMALL_MAX_EXPERTS + 1), 2), (scores, 17)):
        with pytest.raises(ValueError, match="top_experts_small"):
            mod.top_experts_small(bad, n)
    got, want = mod.top_experts_engine(scores, 3), top_experts(scores, 3)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    torch.library.opcheck(mod.top_experts_engine, (scores, 3))


def _situ_reference(z_TZ, layout, w_GNZ, beta, lb):
    """The three steps the engine's fused kernel replaces: the permute, the grouped gate/up product, SiTU-GLU."""
    x_PZ = moe_kernels.permute_reference(z_TZ, layout)
    g_PI, u_PI = grouped_mm_naive(x_PZ, w_GNZ, layout.offs_E).chunk(2, dim=-1)
    return situ_glu_reference(g_PI, u_PI, beta, lb)


# half precision as fp16: the interpreter multiplies bf16 tiles as their raw bits (Triton 3.9's interpreter
# converts only 8-bit floats before its matmul)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tiles", [None, (16, 16, 32), (32, 64, 16)])  # by rows; narrower and wider than I = 40
def test_permute_situ_small_equals_permute_product_and_activation(monkeypatch, dtype, tol, tiles):
    """The decode step's permute + gate/up product + SiTU in one kernel, under TRITON_INTERPRET=1, against the three
    steps: 30 tokens at top-3 over 6 experts with groups padded to 8 rows (padding rows read zeros), one expert
    unused, one with more rows than a row tile, the weight a strided view, I = 40 (a partial column tile); rows
    past offs[-1] never written, rows inside every group equal (padding rows' h is SiTU(0, 0) = 0)."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(3)
    T, k, E, Z, I = 30, 3, 6, 24, 40
    experts = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])  # expert 5 unused
    experts[:20, 0] = 2  # expert 2 on 20+ rows
    layout = moe_kernels.route_layout(experts, E, align=8)
    z = torch.randn(T, Z).to(dtype)
    w = (torch.randn(E, Z, 2 * I) / Z**0.5).to(dtype).transpose(1, 2)  # [E, 2I, Z], not contiguous
    want = _situ_reference(z, layout, w, 4.0, 25.0)
    got = mod.permute_situ_small(z, layout.src_row_P, layout.offs_E, w, 4.0, 25.0,
                                 None if tiles is None else mod.SmallTiles(*tiles))  # fmt: skip
    end = int(layout.offs_E[-1])
    assert got.shape == (layout.rows, I) and got.dtype == dtype
    assert_close("h", want[:end].float(), got[:end].float(), tol)
    padding = layout.src_row_P[:end] == T
    assert padding.any() and torch.equal(got[:end][padding], torch.zeros_like(got[:end][padding]))


def test_permute_situ_launch_and_bad_input():
    """Half the plain product's columns a program (two accumulators), 128-wide k tiles from 1,024 rows (the --situ
    sweep's table); mismatched operands named."""
    mod = _interpreted_triton_module()
    assert mod.situ_tiles(960) == mod.SmallTiles(bn=32)
    assert mod.situ_tiles(1024) == mod.situ_tiles(3000) == mod.SmallTiles(bn=32, bk=128)
    z, src, offs = torch.randn(4, 8), torch.zeros(6, dtype=torch.long), torch.tensor([6, 6], dtype=torch.int32)
    for w in (torch.randn(2, 10, 6), torch.randn(2, 9, 8), torch.randn(2, 10, 8).double()):
        with pytest.raises(ValueError, match="permute_situ"):
            mod.permute_situ_small(z, src, offs, w, 4.0, 25.0)


def test_permute_situ_engine_off_cuda_takes_the_three_steps(monkeypatch):
    """The engine's op off CUDA (and on CUDA past SMALL_ROWS_MAX rows): the permute, the grouped product and the
    activation, equal to the three steps, the kernel not called; its fake agrees under ``torch.library.opcheck``
    (schema, fake, dynamic shapes: what a compiled MoE block does with it)."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(4)
    layout = moe_kernels.route_layout(torch.randint(0, 4, (10, 2)), 4, align=1)
    z, w = torch.randn(10, 16), torch.randn(4, 32, 16) / 4
    monkeypatch.setattr(mod, "permute_situ_small", None)  # a call would raise
    args = (z, layout.src_row_P, layout.offs_E, w, 4.0, 25.0)
    assert_close("off CUDA", _situ_reference(z, layout, w, 4.0, 25.0), mod.permute_situ_engine(*args), 1e-6)
    torch.library.opcheck(mod.permute_situ_engine, args)


@pytest.mark.parametrize("T, E, n, renormalize, scaling", [(64, 128, 8, True, 1.0), (5, 20, 3, False, 2.5),
                                                           (3, 7, 7, True, 0.5), (1100, 8, 2, True, 2.5)])  # fmt: skip
def test_select_experts_small_equals_the_gates_steps(monkeypatch, T, E, n, renormalize, scaling):
    """The engine's one-launch selection under TRITON_INTERPRET=1 against the gate's sigmoid, sort and weights: the
    same experts in the same order (ties in scores + bias to the lower expert), weights to fp32 rounding; E not a
    power of two, n = E, rows strided."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(T + E)
    logits = (3 * torch.randn(T, E + 2))[:, :E]  # rows strided
    logits[0, : E // 2] = 0.25  # half a row tied
    bias = 0.1 * torch.randn(E)
    bias[: E // 2] = 0.0
    want_i, want_w = select_experts(logits, bias, n, renormalize, scaling)
    got_i, got_w = mod.select_experts_small(logits, bias, n, renormalize, scaling)
    assert torch.equal(got_i, want_i)
    assert got_w.dtype == torch.float32 and torch.allclose(got_w, want_w, rtol=1e-6, atol=0)


def test_select_experts_refuses_what_it_does_not_take_and_the_engine_op_takes_the_gates_steps(monkeypatch):
    """bf16 logits, a bias of the wrong size or n past E are a ValueError; the engine's op off CUDA (and for rows
    the kernel does not take) is the gate's steps, exactly; its fake agrees under ``torch.library.opcheck``."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, bias = torch.randn(4, 16), torch.randn(16)
    for bad_logits, bad_bias, n in ((logits.bfloat16(), bias, 2), (logits, bias[:8], 2), (logits, bias, 17)):
        with pytest.raises(ValueError, match="select_experts_small"):
            mod.select_experts_small(bad_logits, bad_bias, n, True, 1.0)
    got, want = mod.select_experts_engine(logits, bias, 3, True, 1.0), select_experts(logits, bias, 3, True, 1.0)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    torch.library.opcheck(mod.select_experts_engine, (logits, bias, 3, True, 1.0))


def test_one_launch_selections_give_expert_ids_in_range_for_nan_rows(monkeypatch):
    """A CUDA graph's padding rows may hold NaN (nothing reads their results): the one-launch top-k and selection
    still give every row distinct expert ids in [0, E) (a NaN counts as -inf), where an out-of-range id would fault
    the layout after them; finite rows as before."""
    mod = _interpreted_triton_module()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.randn(4, 16)
    logits[1] = float("nan")
    logits[2, ::2] = float("nan")
    for idx in (mod.top_experts_small(logits, 4)[1], mod.select_experts_small(logits, torch.zeros(16), 4, True, 1.0)[0]):
        assert int(idx.min()) >= 0 and int(idx.max()) < 16
        assert all(len(set(row.tolist())) == 4 for row in idx)
        assert torch.equal(idx[1], torch.arange(4))  # all NaN: the lowest experts
        assert bool((idx[2] % 2 == 1).all())  # the finite (odd) experts first


def test_the_engines_selection_takes_prefill_rows_only_with_prefill_routing_on_triton(monkeypatch):
    """The engine's top-k / selection ops take a decode step's rows on the one-launch kernels, and a prefill step's
    (past ``TOP_SMALL_MAX_ROWS``) only with ``set_prefill_routing(True)`` (an engine's default;
    ``LONGHORIZON_PREFILL_ROUTING=torch`` sets False); never off CUDA or for scores the kernel does not take."""
    from types import SimpleNamespace

    mod = _interpreted_triton_module()
    monkeypatch.setattr(mod, "_PREFILL_ON_TRITON", False)
    scores = lambda rows, cuda=True, dtype=torch.float32: SimpleNamespace(
        shape=(rows, 128), is_cuda=cuda, dtype=dtype)
    assert mod._engine_takes_rows(scores(64), 8) and mod._engine_takes_rows(scores(mod.TOP_SMALL_MAX_ROWS), 8)
    assert not mod._engine_takes_rows(scores(mod.TOP_SMALL_MAX_ROWS + 1), 8)
    mod.set_prefill_routing(True)
    assert mod._engine_takes_rows(scores(16384), 8)
    assert not mod._engine_takes_rows(scores(16384, cuda=False), 8)
    assert not mod._engine_takes_rows(scores(16384, dtype=torch.bfloat16), 8)
    assert not mod._engine_takes_rows(scores(64), 129)
    mod.set_prefill_routing(False)
    assert not mod._engine_takes_rows(scores(16384), 8)
