"""Triton KDA kernels under TRITON_INTERPRET=1 against the float64 reference (kernels/kda/naive.py).

The interpreter is chosen when a @triton.jit function is decorated, so this module imports the kernel
modules with TRITON_INTERPRET=1 set (re-importing them if another test loaded them for a GPU) and puts
the variable back afterwards; the conftest's ``triton_interpreter`` converts bfloat16 tl.dot operands to fp32
(the interpreter's bug it works around is described there).
Every fresh allocation inside the kernels' host code is poisoned with NaN while they run.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kda.naive import naive_recurrent_kda
from kernels.testing import import_interpreted

_MODULES = ["common", "launch", "fwd", "bwd", "chunk", "decode"]


triton = pytest.importorskip("triton")
MODS = dict(zip(_MODULES, import_interpreted(*(f"kernels.kda.triton.{name}" for name in _MODULES))))
chunk_kda_triton = MODS["chunk"].chunk_kda_triton
fused_recurrent_kda_triton = MODS["decode"].fused_recurrent_kda_triton


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # bf16 tl.dot operands fixed there


@pytest.fixture(autouse=True)
def nan_poison(monkeypatch):
    """torch.empty / empty_like in the kernels' modules return NaN-filled floating tensors."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    class PoisonedTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            return poison(empty(*args, **kwargs))

        @staticmethod
        def empty_like(*args, **kwargs):
            return poison(empty_like(*args, **kwargs))

    for name in ("fwd", "bwd", "chunk", "decode"):
        monkeypatch.setattr(MODS[name], "torch", PoisonedTorch())


def _inputs(T, H=1, K=16, V=32, B=1, N=None, dtype=torch.float32, gate="random", seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)
    q = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
    v = rand(B, T, H, V)
    if gate == "saturated":  # every channel at the bound: the worst case for the 16-token tiles
        g = torch.full((B, T, H, K), -5.0)
    else:
        g = -5.0 * torch.sigmoid(2 * rand(B, T, H, K))
    beta = torch.sigmoid(rand(B, T, H))
    h0 = rand(N if N is not None else B, H, K, V)
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype), h0]


def _run_both(ins, cu_seqlens=None, seed=1):
    """Forward + backward of the Triton path and the float64 reference on the same inputs and grads."""
    ref_in = [x.detach().double().requires_grad_() for x in ins]
    tri_in = [x.detach().clone().requires_grad_() for x in ins]
    o_ref, h_ref = naive_recurrent_kda(
        *ref_in[:5], initial_state=ref_in[5], output_final_state=True, cu_seqlens=cu_seqlens
    )
    o, h = chunk_kda_triton(
        *tri_in[:5], initial_state=tri_in[5], output_final_state=True, cu_seqlens=cu_seqlens
    )
    gen = torch.Generator().manual_seed(seed)
    do, dht = (
        torch.randn(o_ref.shape, generator=gen).double(),
        torch.randn(h_ref.shape, generator=gen).double(),
    )
    ((o_ref * do).sum() + (h_ref * dht).sum()).backward()
    ((o.double() * do).sum() + (h.double() * dht).sum()).backward()
    got = {"o": o, "ht": h} | {n: x.grad for n, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), tri_in)}
    want = {"o": o_ref, "ht": h_ref} | {
        n: x.grad for n, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ref_in)
    }
    return got, want


def _assert_close(got, want, tol):
    for name, ref in want.items():
        out = got[name]
        assert out is not None and out.shape == ref.shape, name
        assert torch.isfinite(out).all(), f"{name}: non-finite values (NaN-poisoned memory read?)"
        err = (out.double() - ref).abs().max().item()
        bound = tol.get(name, tol["default"]) * max(1.0, ref.abs().max().item())
        assert err <= bound, f"{name}: max abs err {err:.3e} > {bound:.3e}"


FP32_TOL = {"default": 2e-5}


@pytest.mark.parametrize("T", [1, 15, 17, 63, 65, 100])
def test_fp32_forward_backward_matches_reference(T):
    got, want = _run_both(_inputs(T))
    _assert_close(got, want, FP32_TOL)


def test_saturated_gate_two_heads():
    got, want = _run_both(_inputs(80, H=2, K=32, V=16, gate="saturated"))
    _assert_close(got, want, FP32_TOL)


def test_varlen_with_states_and_empty_sequence():
    cu = torch.tensor([0, 15, 15, 80, 97])
    got, want = _run_both(_inputs(97, N=4), cu_seqlens=cu)
    _assert_close(got, want, FP32_TOL)


def test_batched_equals_reference():
    got, want = _run_both(_inputs(20, B=2))
    _assert_close(got, want, FP32_TOL)


def _rms_rel(got, want):
    return ((got.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("prec", ["bf16x3", "bf16"])
def test_bf16_per_tensor_tolerances(prec, monkeypatch):
    monkeypatch.setenv("LONGHORIZON_KDA_INTRA_PREC", prec)
    # Strong decay and D = 64: the regime where dG's pair terms are large next to dg itself.
    ins = _inputs(128, H=1, K=64, V=64, dtype=torch.bfloat16)
    ins[3] = -5.0 * torch.sigmoid(torch.randn(ins[3].shape, generator=torch.Generator().manual_seed(3)) + 1)
    got, want = _run_both(ins)
    # bf16 storage carries 8 bits of mantissa; dg sums per-position terms through a reverse cumsum.
    tol = {"default": 3e-2, "o": 2e-2, "ht": 2e-2, "dg": 3e-2}
    _assert_close(got, want, tol)
    # The default split products keep the pair terms of dG accurate enough to cancel; single bf16 does not.
    dg_err = _rms_rel(got["dg"], want["dg"])
    if prec == "bf16x3":
        assert dg_err < 2e-2, dg_err  # single bf16 products: ~0.1 here
    print(f"{prec}: dg rms rel err {dg_err:.2e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_products_are_ieee_and_half_ones_stay_on_tensor_cores(dtype, monkeypatch):
    """Under the interpreter every tl.dot of the chunk kernels (forward and backward) with fp32 operands
    asks for IEEE fp32 (on the GPU: bf16x3, the next test), never the TF32 of a plain fp32 tl.dot (2e-3
    relative on the H200, where the fp32 state kernel also hit an illegal memory access with it).
    bf16 products keep the default."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as ti

    seen = []
    create_dot = ti.InterpreterBuilder.create_dot

    def record(self, a, b, d, input_precision, max_num_imprecise_acc):
        seen.append((a.dtype.scalar.name, b.dtype.scalar.name, input_precision))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", record)
    got, want = _run_both(_inputs(70, H=1, K=16, V=16, dtype=dtype))
    fp32 = [p for a, b, p in seen if a == b == "fp32"]
    assert fp32, "no fp32 products recorded"
    if dtype == torch.float32:
        assert len(fp32) == len(seen), sorted({(a, b) for a, b, _ in seen})
        assert all(p == ir.INPUT_PRECISION.IEEE for p in fp32), sorted({str(p) for p in fp32})
        _assert_close(got, want, FP32_TOL)
    else:  # the bf16 kernels' products stay bf16 (tensor cores); only the fp32 substitution tiles are IEEE
        assert any(a == b == "bf16" for a, b, _ in seen)


def test_fp32_split_products_of_the_gpu_match_reference(monkeypatch):
    """On the GPU fp32 products are bf16x3 (common.FP32_SPLIT): about 16 mantissa bits, far inside the
    tolerance TF32's ~2e-3 failed, and every product a bf16 one."""
    import triton.language as tl
    from triton.runtime import interpreter as ti

    monkeypatch.setattr(MODS["common"], "FP32_SPLIT", tl.constexpr(True))
    seen = []
    create_dot = ti.InterpreterBuilder.create_dot

    def record(self, a, b, d, input_precision, max_num_imprecise_acc):
        seen.append((a.dtype.scalar.name, b.dtype.scalar.name))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", record)
    got, want = _run_both(_inputs(100, H=2, K=32, V=32))
    _assert_close(got, want, {"default": 2e-4})
    assert ("bf16", "bf16") in seen


@pytest.mark.parametrize("split", [True, False], ids=["bf16x3", "ieee"])
def test_a_last_bit_input_change_moves_fp32_products_by_their_precision(monkeypatch, split):
    """Why the fp32 engines of the greedy check take IEEE products: a one-ulp change of q, k, v moves the exact
    function by ~2e-7 of the output's scale; IEEE products keep it there, bf16x3 rounds each operand's low part
    to bf16 and moves the output ~40x further (~8e-6 on this case; two engines whose inputs differ in the last
    bit then part at a near-tied router). The bound between them separates the two by 10x either way."""
    import triton.language as tl

    monkeypatch.setattr(MODS["common"], "FP32_SPLIT", tl.constexpr(split))
    q, k, v, g, beta, _ = _inputs(128, K=32, V=32)
    nudge = lambda x: torch.nextafter(x, torch.full_like(x, float("inf")))
    o1, _ = chunk_kda_triton(q, k, v, g, beta)
    o2, _ = chunk_kda_triton(nudge(q), nudge(k), nudge(v), g, beta)
    exact1, _ = naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)))
    exact2, _ = naive_recurrent_kda(*(x.double() for x in (nudge(q), nudge(k), nudge(v), g, beta)))
    scale = o1.abs().max().item()
    moved, exact = (o1 - o2).abs().max().item() / scale, (exact1 - exact2).abs().max().item() / scale
    assert exact < 5e-7 and (o1.double() - exact1).abs().max().item() / scale < 1e-4  # both precisions near fp64
    assert (moved > 10 * exact) if split else (moved < 4 * exact), (moved, exact)


def test_fp32_products_switch_reads_the_environment(monkeypatch):
    """LONGHORIZON_KDA_FP32_PRODUCTS picks the GPU's fp32 products (bf16x3 unless "ieee"); a typo is an error
    naming the variable, not a silent default."""
    common = MODS["common"]
    monkeypatch.delenv("LONGHORIZON_KDA_FP32_PRODUCTS", raising=False)
    assert common.fp32_products() == "bf16x3"
    monkeypatch.setenv("LONGHORIZON_KDA_FP32_PRODUCTS", "ieee")
    assert common.fp32_products() == "ieee"
    monkeypatch.setenv("LONGHORIZON_KDA_FP32_PRODUCTS", "fp32")
    with pytest.raises(ValueError, match="LONGHORIZON_KDA_FP32_PRODUCTS"):
        common.fp32_products()


def test_launch_configs_one_per_kernel_unless_searching(monkeypatch):
    """fp32 (the reference precision) compiles the first config everywhere; bf16 on a GPU with a tuned
    table compiles the recorded winner; elsewhere, or with LONGHORIZON_KDA_AUTOTUNE=1, the whole space."""
    launch = MODS["launch"]
    monkeypatch.delenv("LONGHORIZON_KDA_AUTOTUNE", raising=False)
    space = launch.full_space("_state_kernel")
    fp32, bf16 = torch.float32, torch.bfloat16
    assert launch.choose("_state_kernel", space, fp32, (9, 0)) == space[:1]
    assert launch.choose("_state_kernel", space, fp32, None) == space[:1]
    (tuned,) = launch.choose("_state_kernel", space, bf16, (9, 0))
    assert (tuned.kwargs, tuned.num_warps, tuned.num_stages) == ({"BV": 16}, 4, 3)
    assert launch.choose("_state_kernel", space, bf16, (8, 0)) == space  # no table for that GPU
    assert launch.choose("_state_kernel", space, bf16, None) == space
    monkeypatch.setenv("LONGHORIZON_KDA_AUTOTUNE", "1")
    assert launch.choose("_state_kernel", space, bf16, (9, 0)) == space
    assert launch.choose("_state_kernel", space, fp32, (9, 0)) == space[:1]


def test_every_kernel_prunes_by_its_own_name_and_every_tuned_config_is_in_its_space():
    """A typo in TUNED would silently fall back to the whole search: each entry must be a config of its
    kernel's space, and each autotuned kernel must prune under its own name."""
    launch = MODS["launch"]
    kernels = {**{k: MODS["fwd"] for k in ("_diag_kernel", "_offdiag_kernel", "_wy_kernel", "_state_kernel",
                                            "_output_kernel")},
               **{k: MODS["bwd"] for k in ("_dav_kernel", "_state_bwd_kernel", "_main_bwd_kernel",
                                            "_intra_bwd_kernel")}}  # fmt: skip
    assert set(kernels) == set(launch.SPACE)
    for name, module in kernels.items():
        assert getattr(module, name).early_config_prune.kernel == name
    for table in launch.TUNED.values():
        assert set(table) == set(launch.SPACE)
        for name, (blocks, warps, stages) in table.items():
            space = [(c.kwargs, c.num_warps, c.num_stages) for c in launch.full_space(name)]
            assert (blocks, warps, stages) in space, name
    io = {"W": torch.zeros(1), "G": torch.zeros(1, dtype=torch.bfloat16)}  # the I/O dtype is W's
    assert launch._io_dtype(io) == torch.float32
    assert (
        launch._io_dtype({"q": torch.zeros(1, dtype=torch.bfloat16), "G": torch.zeros(1)}) == torch.bfloat16
    )


def test_without_state_and_grads_only_on_output():
    q, k, v, g, beta, _ = (x.requires_grad_() for x in _inputs(33))
    o, h = chunk_kda_triton(q, k, v, g, beta)
    assert h is None
    o.sum().backward()
    qr, kr, vr, gr, br = (x.detach().double().requires_grad_() for x in (q, k, v, g, beta))
    o_ref, _ = naive_recurrent_kda(qr, kr, vr, gr, br)
    o_ref.sum().backward()
    assert (o.double() - o_ref).abs().max() < 2e-5
    for a, b in ((q, qr), (k, kr), (v, vr), (g, gr), (beta, br)):
        assert (a.grad.double() - b.grad).abs().max() < 1e-4


def test_debug_mode_checks_the_gate_contract(monkeypatch):
    q, k, v, g, beta, _ = _inputs(5)
    g[0, 2, 0, 3] = -5.5
    monkeypatch.setenv("LONGHORIZON_KDA_DEBUG", "1")
    with pytest.raises(ValueError, match="g >= -5"):
        chunk_kda_triton(q, k, v, g, beta)


def test_bad_shapes_are_named():
    q, k, v, g, beta, _ = _inputs(5)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_triton(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="dtype"):
        chunk_kda_triton(q, k, v.double(), g, beta)


def test_decode_matches_reference_and_updates_pool_in_place():
    cu = torch.tensor([0, 1, 3, 3, 5, 6])
    q, k, v, g, beta, _ = _inputs(6, H=2)
    pool = torch.randn(7, 2, 16, 32)
    before = pool.clone()
    idx = torch.tensor([5, 0, 2, 3, -1])  # an empty sequence, and a padded last entry (slot -1)
    o, out = fused_recurrent_kda_triton(
        q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, state_indices=idx
    )
    assert out is pool
    live = idx[:4]
    o_ref, h_ref = naive_recurrent_kda(
        *(x[:, :5] for x in (q, k, v, g, beta)),
        initial_state=before[live],
        output_final_state=True,
        cu_seqlens=cu[:5],
    )
    assert (o[:, :5] - o_ref).abs().max() < 1e-5
    assert torch.equal(o[:, 5], torch.zeros_like(o[:, 5]))
    assert (pool[live] - h_ref).abs().max() < 1e-5
    untouched = [1, 4, 6]
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_without_pool_matches_reference():
    q, k, v, g, beta, h0 = _inputs(4, B=2, H=2)
    o, h = fused_recurrent_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, h_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert (o - o_ref).abs().max() < 1e-5 and (h - h_ref).abs().max() < 1e-5


def test_chunk_plan_cached_per_cu_seqlens_and_validated():
    common = MODS["common"]
    cu = torch.tensor([0, 37, 200, 200, 511], dtype=torch.int64)
    plan = common.plan_chunks(1, 511, cu, torch.device("cpu"))
    assert common.plan_chunks(1, 511, cu, torch.device("cpu")) is plan
    assert plan.num_seqs == 4 and plan.num_chunks == 1 + 3 + 0 + 5
    assert plan.chunk_indices_C2.tolist()[:5] == [[0, 0], [1, 0], [1, 1], [1, 2], [3, 0]]
    assert plan.chunk_offsets_N1.tolist() == [0, 1, 4, 4, 9]
    cu[1] = 100  # in place: a new version, so a new plan
    again = common.plan_chunks(1, 511, cu, torch.device("cpu"))
    assert again is not plan and again.chunk_offsets_N1.tolist() == [0, 2, 4, 4, 9]
    assert again.chunk_indices_C2.tolist()[:5] == [[0, 0], [0, 1], [1, 0], [1, 1], [3, 0]]
    with pytest.raises(ValueError, match="run from 0 to T"):
        common.plan_chunks(1, 512, torch.tensor([0, 100]), torch.device("cpu"))
    with pytest.raises(ValueError, match="non-decreasing"):
        common.plan_chunks(1, 100, torch.tensor([0, 60, 50, 100]), torch.device("cpu"))


def test_chunk_plan_built_from_the_callers_host_bounds():
    """The model passes its layout's host copy of cu_seqlens: the plan equals the one read from the
    tensor, and later calls with the same tensor (every KDA layer) hit it."""
    common = MODS["common"]
    cu = torch.tensor([0, 37, 200, 200, 511])
    cpu = torch.device("cpu")
    primed = common.plan_chunks(1, 511, cu, cpu, bounds=[0, 37, 200, 200, 511])
    assert common.plan_chunks(1, 511, cu, cpu) is primed
    read = common.plan_chunks(1, 511, cu.clone(), cpu)
    assert read is not primed
    for a, b in ((primed.chunk_indices_C2, read.chunk_indices_C2), (primed.chunk_offsets_N1, read.chunk_offsets_N1),
                 (primed.cu_seqlens_N1, read.cu_seqlens_N1)):  # fmt: skip
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="non-decreasing"):
        common.plan_chunks(1, 511, cu.clone(), cpu, bounds=[0, 300, 200, 511])


def test_chunk_plan_of_an_inference_tensor_is_keyed_by_its_values():
    """vLLM runs the model under torch.inference_mode, so its cu_seqlens are inference tensors: they
    have no version counter (reading ``_version`` raises) and may change in place without a trace."""
    common = MODS["common"]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        cu = torch.tensor([0, 37, 200, 511])
        plan = common.plan_chunks(1, 511, cu, cpu)
        assert plan.chunk_offsets_N1.tolist() == [0, 1, 4, 9]
        assert common.plan_chunks(1, 511, cu.clone(), cpu) is plan  # same values: a hit
        cu[1] = 100  # in place, invisible to any version counter
        again = common.plan_chunks(1, 511, cu, cpu)
        assert again is not plan and again.chunk_offsets_N1.tolist() == [0, 2, 4, 9]
        with pytest.raises(ValueError, match="non-decreasing"):
            common.plan_chunks(1, 511, torch.tensor([0, 300, 200, 511]), cpu)
    # the same values as a normal tensor are keyed by identity: a plan of their own
    assert common.plan_chunks(1, 511, torch.tensor([0, 100, 200, 511]), cpu) is not again


def test_inference_tensor_plans_take_the_callers_host_bounds_without_a_device_read(monkeypatch):
    """A rollout engine's KDA layers hold their step's offsets on the host: priming with ``bounds`` and the kernel's
    own lookups inside a ``host_bounds`` block read nothing back (``_bounds`` is the device read), and give the plan
    a read would. Outside the block the tensor is read again: it may have changed in place since."""
    common = MODS["common"]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        values = [0, 37, 200, 200, 511]
        read = common.plan_chunks(1, 511, torch.tensor(values), cpu)
        common._PLAN_CACHE.clear()
        cu = torch.tensor(values)
        reads = []
        monkeypatch.setattr(common, "_bounds", lambda t: reads.append(t) or [int(x) for x in t.tolist()])
        primed = common.plan_chunks(1, 511, cu, cpu, bounds=values)
        with common.host_bounds(cu, values):
            assert common.plan_chunks(1, 511, cu, cpu) is primed
            other = torch.tensor([0, 100, 511])  # not the scoped tensor: read
            assert common.plan_chunks(1, 511, other, cpu).num_seqs == 2 and len(reads) == 1
        assert len(reads) == 1
        for a, b in ((primed.chunk_indices_C2, read.chunk_indices_C2), (primed.chunk_offsets_N1, read.chunk_offsets_N1),
                     (primed.cu_seqlens_N1, read.cu_seqlens_N1)):  # fmt: skip
            assert torch.equal(a, b)
        cu[1] = 100  # in place after the block: the next lookup reads the new values
        assert common.plan_chunks(1, 511, cu, cpu).chunk_offsets_N1.tolist() == [0, 2, 4, 4, 9] and len(reads) == 2
        with pytest.raises(ValueError, match="not the 5 offsets"):
            common.plan_chunks(1, 511, cu, cpu, bounds=[0, 511])
        with pytest.raises(RuntimeError), common.host_bounds(cu, values):
            raise RuntimeError("the block fails")
        assert common._HOST_BOUNDS == []  # popped on the error too


def test_forward_under_inference_mode_equals_the_plain_forward():
    cu = torch.tensor([0, 15, 80, 97])
    q, k, v, g, beta, h0 = _inputs(97, N=3)
    o, h = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    with torch.inference_mode():
        o_inf, h_inf = chunk_kda_triton(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu.clone()
        )
    assert torch.equal(o, o_inf) and torch.equal(h, h_inf)


@pytest.mark.parametrize("bkf, bv", [(16, 16), (32, 64), (128, 32)])
def test_every_main_backward_block_shape_matches_reference(bkf, bv, monkeypatch):
    """The GPU autotuner may pick any feature/value block of the main backward; the interpreter only
    runs the first, so each shape is pinned here in turn: several feature blocks (K = 48 with 16),
    a block wider than K (128), value blocks narrower and wider than V, two chunks with a ragged end."""
    kernel = MODS["bwd"]._main_bwd_kernel
    monkeypatch.setattr(kernel, "configs", [triton.Config({"BKF": bkf, "BV": bv}, num_warps=4, num_stages=2)])
    monkeypatch.setattr(kernel, "cache", {})
    got, want = _run_both(_inputs(100, H=2, K=48, V=40, seed=5))
    _assert_close(got, want, FP32_TOL)


@pytest.mark.parametrize("bkb, bko", [(16, 16), (32, 32), (128, 64)])
def test_every_intra_feature_block_matches_reference(bkb, bko, monkeypatch):
    """The intra backward (one program per sub-tile row and feature block, dbeta summed over blocks)
    and the forward's off-diagonal pairs (feature blocks in a loop) at each block width the GPU
    autotuner may pick: K = 48 gives three blocks of 16, one ragged block of 32 and one wider block."""
    for name, mod, cfg in (
        ("_intra_bwd_kernel", "bwd", {"BKB": bkb}),
        ("_offdiag_kernel", "fwd", {"BKO": bko}),
    ):
        kernel = getattr(MODS[mod], name)
        monkeypatch.setattr(kernel, "configs", [triton.Config(cfg, num_warps=4, num_stages=1)])
        monkeypatch.setattr(kernel, "cache", {})
    got, want = _run_both(_inputs(100, H=2, K=48, V=40, seed=6))
    _assert_close(got, want, FP32_TOL)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens", [None, 3])
@pytest.mark.parametrize("layout", ["paged", "transposed"])
def test_pool_decode_step_equals_the_torch_pool_step(tokens, layout, slot_dtype):
    """What `kda_decode_step_` runs on CUDA, against its CPU path: one token ([N, H, K]) or three
    ([N, T, H, K]) per sequence, a padding entry (-1), slots out of order. "paged": fp32 states whose
    slots are contiguous but strided (vLLM keeps the conv states in the same pages), stepped in place
    by index; "transposed": slots not contiguous, so gathered, stepped and scattered back."""
    from kernels.kda import kda_decode_step_

    gen = torch.Generator().manual_seed(13)
    N, H, K, V, P = 3, 2, 16, 32, 5
    lead = (N,) if tokens is None else (N, tokens)
    q, k = (torch.nn.functional.normalize(torch.randn(*lead, H, K, generator=gen), dim=-1) for _ in range(2))
    v, g = torch.randn(*lead, H, V, generator=gen), -torch.rand(*lead, H, K, generator=gen)
    beta = torch.rand(*lead, H, generator=gen)
    if layout == "paged":
        pages = torch.randn(P, H * K * V + 7, generator=gen) * 0.1  # 7 extra values per slot: another state
        pool = pages[:, : H * K * V].view(P, H, K, V)
        assert not pool.is_contiguous() and MODS["decode"].slot_contiguous_fp32(pool)
    else:
        pool = (torch.randn(P, H, V, K, generator=gen) * 0.1).transpose(-1, -2)
        assert not MODS["decode"].slot_contiguous_fp32(pool)
    slots = torch.tensor([3, -1, 0], dtype=slot_dtype)  # vLLM's ids are int32: read as they are
    ref_pool, bf16_pool = pool.clone(), pool.clone()
    o_ref = kda_decode_step_(q, k, v, g, beta, ref_pool, slots)
    o = MODS["decode"].pool_decode_step_triton(q, k, v, g, beta, pool, slots)
    assert o.shape == v.shape and torch.equal(o[1], torch.zeros_like(o[1]))
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(pool, ref_pool, atol=2e-5, rtol=0)
    assert torch.equal(pool[[1, 2, 4]], ref_pool[[1, 2, 4]])  # untouched slots, bit for bit
    # out_dtype: the fp32 result rounded on store (the engine asks for its residual stream's dtype). A GPU
    # rounds to nearest even (Triton's default for a float downcast), as torch's cast; the interpreter
    # truncates: within one bf16 step of the fp32 result, towards zero
    o_bf16 = MODS["decode"].pool_decode_step_triton(q, k, v, g, beta, bf16_pool, slots, out_dtype=torch.bfloat16)
    ulp = torch.ldexp(torch.ones_like(o), torch.frexp(o).exponent - 8)  # bf16's spacing at |o| (8 mantissa bits)
    assert o_bf16.dtype == torch.bfloat16 and bool(((o_bf16.float() - o).abs() < ulp).all())
    assert bool((o_bf16.float().abs() <= o.abs()).all()) or torch.equal(o_bf16, o.to(torch.bfloat16))
    assert torch.equal(bf16_pool, pool)  # the states as without out_dtype


def test_a_plan_padded_to_a_static_shape_gives_the_same_values_and_gradients():
    """``plan_chunks(chunks_to=...)`` (a learner's static layout under CUDA graphs): zero-length sequences after the
    batch and the chunk list padded to ``padded_chunk_count`` with empty chunks give the unpadded plan's output and
    gradients bit for bit (scratch buffers NaN-poisoned: a padded chunk that read or wrote a real slot would show)."""
    chunk, common = MODS["chunk"], MODS["common"]
    lengths = [1, 15, 70]
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_pad = torch.cat([cu, cu.new_full((2,), T)])  # two empty sequences: 5 in all
    q, k, v, g, beta, _ = _inputs(T, H=2, seed=6)
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(7))
    plan = common.plan_chunks(1, T, cu, q.device)
    padded = common.plan_chunks(1, T, cu_pad, q.device, chunks_to=common.padded_chunk_count(T, 5))
    assert (plan.num_chunks, padded.num_chunks) == (4, 7) and padded.num_seqs == 5

    def grads(p):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
        o = chunk.chunk_kda_planned(*leaves, p.cu_seqlens_N1, p.chunk_indices_C2, p.chunk_offsets_N1, 0.25)
        return [o.detach(), *torch.autograd.grad(o, leaves, do)]

    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), grads(plan), grads(padded)):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="less than the plan's 4 chunks"):
        common.plan_chunks(1, T, cu, q.device, chunks_to=3)


def test_planned_ops_equal_the_autograd_function_and_trace_whole():
    """``chunk_kda_planned`` (the learner's compiled KDA layer: custom ops under a node with nothing else inside)
    gives the values and gradients of ``chunk_kda_triton`` bit for bit on a packed batch, eagerly and inside a
    graph dynamo captures without a break; the ops' schemas and fake kernels pass ``opcheck``."""
    chunk = MODS["chunk"]
    lengths = [1, 15, 70]  # chunks of 1, 15, 64 and 6 tokens
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, g, beta, _ = _inputs(sum(lengths), H=2, seed=4)
    plan = MODS["common"].plan_chunks(1, q.shape[1], cu, q.device)
    planned = (plan.cu_seqlens_N1, plan.chunk_indices_C2, plan.chunk_offsets_N1)
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(5))

    def grads(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
        o = fn(*leaves)
        return [o.detach(), *torch.autograd.grad(o, leaves, do)]

    want = grads(lambda *x: chunk_kda_triton(*x, scale=0.25, cu_seqlens=cu)[0])
    eager = grads(lambda *x: chunk.chunk_kda_planned(*x, *planned, 0.25))
    compiled_fn = torch.compile(chunk.chunk_kda_planned, backend="aot_eager", fullgraph=True)
    compiled = grads(lambda *x: compiled_fn(*x, *planned, 0.25))
    for name, a, b, c in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), want, eager, compiled):
        assert torch.equal(a, b), name
        assert torch.equal(a, c), name
    flat = [x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    torch.library.opcheck(chunk.kda_chunk_fwd, (*flat, *planned, 0.25), test_utils=("test_schema", "test_faketensor"))
    saved = chunk.kda_chunk_fwd(*flat, *planned, 0.25)[1:]
    torch.library.opcheck(chunk.kda_chunk_bwd, (*flat, *planned, *saved, do[0], 0.25),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
