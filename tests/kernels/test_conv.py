"""Triton varlen causal conv1d under TRITON_INTERPRET=1 against the PyTorch reference (kernels/conv/naive.py),
forward and backward, packed sequences of 1, 15, 64, 65 and 300 tokens and a padded batch; and the model's
ShortConvolution on that kernel against its own tap loop.

The interpreter is chosen when a @triton.jit function is decorated, so this module imports the kernel
module with TRITON_INTERPRET=1 set (re-importing it if another test loaded it) and puts the variable back.
"""

from __future__ import annotations

import pytest
import torch

from kernels.conv.naive import causal_conv1d_naive
from kernels.testing import assert_close, import_interpreted

triton = pytest.importorskip("triton")


(CONV,) = import_interpreted("kernels.conv.triton")
LENGTHS = [1, 15, 64, 65, 300]


pytestmark = pytest.mark.usefixtures("triton_interpreter")


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("backward", CONV.BACKWARD_KERNELS)
@pytest.mark.parametrize("activation, K, C", [("silu", 4, 72), (None, 2, 8), ("silu", 3, 8)])
def test_varlen_conv_matches_reference_fwd_bwd(activation, K, C, backward):
    """C = 72: two channel blocks, the second partial (the interpreter is slow: one such case). The fused
    backward's halo: K = 4 three rows in a tile of four (one masked), K = 3 two in two, K = 2 one in one."""
    torch.manual_seed(0)
    pos = packed_positions(LENGTHS)
    T = pos.shape[1]
    x = torch.randn(1, T, C, requires_grad=True)
    w = torch.randn(C, K, requires_grad=True)
    y = CONV.causal_conv1d_triton(x, w, pos, activation, backward)
    ref = causal_conv1d_naive(x, w, pos, activation)
    assert_close("y", ref, y, 1e-6)
    dy = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)
    assert_close("dx", want[0], got[0], 1e-6)
    assert_close("dw", want[1], got[1], 1e-6)


def test_no_sequence_sees_another():
    pos = packed_positions([5, 7])
    x = torch.randn(1, 12, 8)
    w = torch.randn(8, 4)
    y = CONV.causal_conv1d_triton(x, w, pos)
    x2 = x.clone()
    x2[:, :5] = 100.0  # the first sequence changes
    y2 = CONV.causal_conv1d_triton(x2, w, pos)
    assert torch.equal(y[:, 5:], y2[:, 5:])


def test_padded_batch_and_bf16():
    B, T, C = 3, 70, 16
    pos = torch.arange(T)[None].expand(B, T)  # each row its own sequence
    x = torch.randn(B, T, C).bfloat16()
    w = torch.randn(C, 4)
    y = CONV.causal_conv1d_triton(x, w, pos)
    assert y.dtype == torch.bfloat16
    ref = causal_conv1d_naive(x.float(), w, pos)  # the kernel accumulates in fp32
    assert_close("y bf16", ref, y.float(), 1e-2)
    dy = torch.randn(B, T, C).bfloat16()
    for backward in CONV.BACKWARD_KERNELS:  # dx in bf16 from fp32 sums, dw in w's dtype: every kernel (two_pass_bf16
        # rounds dpre to bf16 once more: within the same bound)
        xg, xf = x.clone().requires_grad_(), x.float().requires_grad_()
        wg, wf = w.clone().requires_grad_(), w.clone().requires_grad_()
        got = torch.autograd.grad(CONV.causal_conv1d_triton(xg, wg, pos, backward=backward), (xg, wg), dy)
        want = torch.autograd.grad(causal_conv1d_naive(xf, wf, pos), (xf, wf), dy.float())
        assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
        assert_close(f"dx bf16 {backward}", want[0], got[0].float(), 1e-2)
        assert_close(f"dw bf16 {backward}", want[1], got[1], 1e-2)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="weight must be"):
        CONV.causal_conv1d_triton(torch.randn(1, 4, 8), torch.randn(6, 4), packed_positions([4]))
    with pytest.raises(ValueError, match="positions must be"):
        CONV.causal_conv1d_triton(torch.randn(1, 4, 8), torch.randn(8, 4), packed_positions([3]))
    with pytest.raises(ValueError, match="activation"):
        CONV.causal_conv1d_triton(torch.randn(1, 4, 8), torch.randn(8, 4), packed_positions([4]), "gelu")
    with pytest.raises(ValueError, match="backward must be one of"):
        CONV.causal_conv1d_triton(torch.randn(1, 4, 8), torch.randn(8, 4), packed_positions([4]), backward="one")


@pytest.mark.parametrize("op", ["triton", "triton_fused", "triton_bf16"])
def test_short_convolution_module_on_the_kernel_equals_its_taps(op):
    from model.fast import use_fast_paths
    from model.layers import ShortConvolution, seq_layout

    conv = ShortConvolution(8, 4)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    x = torch.randn(1, int(cu[-1]), 8, requires_grad=True)
    layout = seq_layout(1, x.shape[1], cu, x.device)
    with use_fast_paths("auto", conv="torch"):
        ref, ref_state = conv(x, layout, need_state=False)
    with use_fast_paths("auto", conv=op):
        y, state = conv(x, layout, need_state=False)
        _, kept = conv(x, layout)  # a state asked for: the tap loop, which returns it
    assert ref_state is None and state is None and kept.shape == (len(LENGTHS), 8, 3)
    assert_close("y", ref, y, 1e-6)
    dy = torch.randn_like(ref)
    got = torch.autograd.grad(y, (x, conv.weight), dy)
    want = torch.autograd.grad(ref, (x, conv.weight), dy)
    assert_close("dx", want[0], got[0], 1e-6)
    assert_close("dw", want[1], got[1], 1e-6)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("silu", [True, False])
def test_conv_state_step_matches_reference_and_skips_padding(dtype, tol, silu):
    """The engine's decode step of the conv: windows in strided state slots (a pool of 6 with room around
    each [C, K-1] window, as vLLM's pages give them), C = 300 over two channel blocks, a padding slot (-1)
    whose output is zero and which touches no window (index -1 must not mean the last slot)."""
    from kernels.conv.naive import conv_state_step_naive_

    torch.manual_seed(0)
    C, K, P = 300, 4, 6
    pages = torch.randn(P, C + 5, K + 2).to(dtype)
    orig = pages.clone()
    pool_ref = pages[:, 2 : 2 + C, 1:K]  # [P, C, K-1], strided
    pages_kern = pages.clone()
    pool_kern = pages_kern[:, 2 : 2 + C, 1:K]
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    x = torch.randn(4, C).to(dtype)
    w = torch.randn(C, K)
    y_ref = conv_state_step_naive_(x, pool_ref, slots, w, silu)
    y = CONV.conv_state_step_triton_(x, pool_kern, slots, w, silu)
    assert_close("y", y_ref.float(), y.float(), tol)
    assert float(y[1].abs().max()) == 0.0 and float(y_ref[1].abs().max()) == 0.0
    assert torch.equal(pages_kern, pages)  # the shifted windows, and nothing else of the pages, as the reference
    assert torch.equal(pool_kern[4, :, -1], x[0]) and torch.equal(pool_kern[0, :, -1], x[2])
    assert torch.equal(pages_kern[[1, 3, 5]], orig[[1, 3, 5]])  # the other slots, the last one (-1) included
    with pytest.raises(ValueError, match="conv_state_step"):
        CONV.conv_state_step_triton_(x, pool_kern, slots[:3], w, silu)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_conv_state_steps_run_a_layers_convs_in_one_launch(parts, monkeypatch):
    """A KDA layer's q, k and v conv steps in one launch: inputs column slices of one projection, states in one page
    layout ([P, 3, C, K-1] pages, each conv's pool a strided view, as vLLM's stacked state slots give them), a
    padding slot; equal to the reference conv by conv, and the launch count is one."""
    from kernels.conv.naive import conv_state_step_naive_

    torch.manual_seed(2)
    C, K, P, N = 40, 4, 5, 4
    pages = torch.randn(P, 3, C + 2, K)
    pools = [pages[:, i, 1 : 1 + C, 1:] for i in range(parts)]
    ref_pages = pages.clone()
    ref_pools = [ref_pages[:, i, 1 : 1 + C, 1:] for i in range(parts)]
    proj = torch.randn(N, 3 * C + 7)
    xs = [proj[:, i * C : (i + 1) * C] for i in range(parts)]
    ws = [torch.randn(C, K) for _ in range(parts)]
    slots = torch.tensor([3, -1, 0, 4], dtype=torch.int32)
    launches = []
    kernel = CONV._conv_state_step
    monkeypatch.setattr(CONV, "_conv_state_step", _Counting(kernel, launches))
    ys = CONV.conv_state_steps_triton_(xs, pools, slots, ws, silu=True)
    assert launches == [(N, 1, parts)]
    for x, pool, w, y in zip(xs, ref_pools, ws, ys, strict=True):
        assert_close("y", conv_state_step_naive_(x, pool, slots, w, True), y, 1e-6)
    assert torch.equal(pages, ref_pages)


def test_conv_state_steps_of_different_layouts_launch_each():
    """States of different layouts (one contiguous pool, one strided) still step, one launch each; more than three
    convs, or mismatched lists, are a ValueError."""
    from kernels.conv.naive import conv_state_step_naive_

    torch.manual_seed(3)
    C, K = 24, 3
    pools = [torch.randn(4, C, K - 1), torch.randn(4, C + 3, K + 1)[:, :C, 1:K]]
    ref = [p.clone() for p in pools]
    xs, ws = [torch.randn(2, C), torch.randn(2, C)], [torch.randn(C, K), torch.randn(C, K)]
    slots = torch.tensor([1, 2], dtype=torch.int32)
    ys = CONV.conv_state_steps_triton_(xs, pools, slots, ws, silu=False)
    for x, pool, w, y, got in zip(xs, ref, ws, ys, pools, strict=True):
        assert_close("y", conv_state_step_naive_(x, pool, slots, w, False), y, 1e-6)
        assert torch.equal(pool, got)
    with pytest.raises(ValueError, match="one to three"):
        CONV.conv_state_steps_triton_(xs * 2, pools * 2, slots, ws * 2, silu=False)
    with pytest.raises(ValueError, match="one to three"):
        CONV.conv_state_steps_triton_(xs, pools[:1], slots, ws, silu=False)


class _Counting:
    """A Triton kernel whose launches record their grid."""

    def __init__(self, kernel, grids: list) -> None:
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.mark.parametrize("dtype, state_dtype, tol", [(torch.float32, torch.float32, 1e-6),
                                                     (torch.bfloat16, torch.float32, 1e-2)])  # fmt: skip
def test_conv_from_states_equals_the_taps(dtype, state_dtype, tol):
    """The engine's prefill over kept sessions: packed sequences of 1, 2, 15, 64 and 65 tokens continuing from
    conv states (the first tokens' taps reach into them), against ``ShortConvolution._conv_taps``; an fp32
    state read in a bf16 model is cast to bf16 first, as the taps cast it. bf16: the taps round every
    partial sum to bf16, the kernel accumulates in fp32."""
    from model.layers import ShortConvolution, seq_layout

    torch.manual_seed(1)
    lengths = [1, 2, 15, 64, 65]
    conv = ShortConvolution(72, 4).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = seq_layout(1, int(cu[-1]), cu, "cpu")
    x = torch.randn(1, int(cu[-1]), 72).to(dtype)
    state = torch.randn(len(lengths), 72, 3, dtype=state_dtype)
    want = conv._conv_taps(x, layout, state)
    got = CONV.causal_conv1d_state_triton(x, conv.weight[:, 0, :], layout.pos_BT, layout.seq_BT, state, "silu")
    assert got.dtype == dtype
    assert_close("y", want.float(), got.float(), tol)
    zero = CONV.causal_conv1d_state_triton(x, conv.weight[:, 0, :], layout.pos_BT, layout.seq_BT, 0 * state, None)
    assert_close("zero state", CONV.causal_conv1d_triton(x, conv.weight[:, 0, :], layout.pos_BT, None).float(),
                 zero.float(), 1e-6)  # fmt: skip
    with pytest.raises(ValueError, match=r"state \[N, C, K-1\]"):
        CONV.causal_conv1d_state_triton(x, conv.weight[:, 0, :], layout.pos_BT, layout.seq_BT, state[..., :2])


def test_short_convolution_prefill_with_state_takes_the_kernel_outside_autograd(monkeypatch):
    """Inference with a conv state in and the final state out (the engine's prefill): the module's output on
    the state kernel equals its taps and its final state is the same; with autograd on it keeps the taps."""
    from model.fast import use_fast_paths
    from model.layers import ShortConvolution, seq_layout

    conv = ShortConvolution(8, 4)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    layout = seq_layout(1, int(cu[-1]), cu, "cpu")
    x = torch.randn(1, int(cu[-1]), 8)
    state = torch.randn(len(LENGTHS), 8, 3)
    calls, kernel = [], CONV.causal_conv1d_state_triton
    monkeypatch.setattr("kernels.conv.triton.causal_conv1d_state_triton", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        with use_fast_paths("auto", conv="torch"):
            ref, ref_state = conv(x, layout, state)
        with use_fast_paths("auto", conv="triton"):
            y, final = conv(x, layout, state)
    assert calls == [1]
    assert_close("y", ref, y, 1e-6)
    assert torch.equal(final, ref_state)
    with use_fast_paths("auto", conv="triton"):
        y_grad, _ = conv(x.requires_grad_(), layout, state)
    assert y_grad.requires_grad
    assert_close("y with autograd (taps)", ref, y_grad.detach(), 1e-6)


def test_the_differentiable_conv_traces_whole_into_a_graph():
    """The learner's KDA layer compiles its convolutions in: the autograd node holds only the two custom ops, so
    dynamo captures it without a break, with eager's values and gradients bit for bit; the ops' schemas and
    fake kernels pass ``opcheck``."""
    torch.manual_seed(3)
    pos = packed_positions([1, 15, 64, 65])
    x = torch.randn(1, pos.shape[1], 24, requires_grad=True)
    w = torch.randn(24, 4, requires_grad=True)
    dy = torch.randn(x.shape)
    compiled = torch.compile(CONV.causal_conv1d_triton, backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (CONV.causal_conv1d_triton, compiled):
        y = fn(x, w, pos, "silu")
        outs.append([y, *torch.autograd.grad(y, (x, w), dy)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    x_RC, pos_R = x.detach()[0].contiguous(), pos[0].to(torch.int32)
    torch.library.opcheck(CONV.conv_varlen_fwd, (x_RC, w.detach(), pos_R, True))
    for kernel in CONV.BACKWARD_KERNELS:
        torch.library.opcheck(CONV.conv_varlen_bwd, (x_RC, w.detach(), pos_R, dy[0], True, kernel),
                              test_utils=("test_schema", "test_faketensor"))  # fmt: skip
