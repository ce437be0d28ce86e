"""The engine's AttnRes mix + RMSNorm kernel (``kernels.attnres``) against the model's reference ops."""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.testing import assert_close, assert_within_ulps, import_interpreted
from model.attnres import attn_res_mix_stacked
from model.layers import rms_norm


def _interpreted():
    pytest.importorskip("triton")
    return import_interpreted("kernels.attnres.triton")[0]


def _reference(q, kw, eps, ow, out_eps, v):
    return rms_norm(attn_res_mix_stacked(q, kw, eps, v), ow, out_eps)


@pytest.mark.parametrize("S", [1, 2, 3, 6])
@pytest.mark.parametrize("D", [64, 48])  # a power of two; a row narrower than its block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_norm_kernel_equals_the_mix_then_the_norm(monkeypatch, S, D, dtype):
    """Sources of different scales (the softmax far from uniform), a query that is not zero, [S, B, T, D]. fp32:
    within 1e-6 (the softmax runs online, summed in another order); bf16: every element within 3 units of the
    last place (the interpreter rounds a bf16 cast toward zero, a GPU to nearest, and the mix is rounded to
    bf16 before the norm, then the output)."""
    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(S * 100 + D)
    v = (torch.randn(S, 2, 5, D, generator=gen) * torch.linspace(0.5, 4.0, S).view(S, 1, 1, 1)).to(dtype)
    q, kw, ow = (torch.randn(D, generator=gen) for _ in range(3))
    got = mod.mix_norm_rows(q, kw, 1e-5, ow, 1e-6, v)
    want = _reference(q, kw, 1e-5, ow, 1e-6, v)
    assert got.dtype == dtype and got.shape == (2, 5, D)
    if dtype == torch.float32:
        assert_close("mix + norm", want, got, 1e-6)
    else:
        assert_within_ulps("mix + norm", want, got, 3)


def test_mix_norm_kernel_names_bad_shapes(monkeypatch):
    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"sources \[S >= 1, \.\.\., D\] and weights \[D\]"):
        mod.mix_norm_rows(torch.zeros(8), torch.zeros(8), 1e-5, torch.zeros(4), 1e-5, torch.zeros(2, 3, 8))


def _sources(S: int, D: int, dtype, seed: int, shape=(2, 7)):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 4.0, S)
    sources = [(torch.randn(*shape, D, generator=gen) * scales[i]).to(dtype) for i in range(S)]
    q, kw, ow = (torch.randn(D, generator=gen) for _ in range(3))
    return sources, q, kw, ow, torch.randn(*shape, D, generator=gen).to(dtype)


@pytest.mark.parametrize("kernel", ["tile", "passes", "rows"])
@pytest.mark.parametrize("S", [2, 3, 6, 8])
@pytest.mark.parametrize("D", [64, 48])
def test_learner_mix_norm_kernels_equal_the_node_reference(monkeypatch, S, D, kernel):
    """The learner's kernels over unstacked sources (``mix_norm_forward``, ``mix_norm_grads``) against
    ``attn_res_mix_norm`` and its closed-form gradient ``attn_res_mix_norm_grads`` (itself held to autograd in
    tests/model/test_attnres.py), fp32, sources of different scales, a non-zero query: the output within 1e-6,
    every gradient within 2e-5 relative to its largest element, with 1, 3 and more programs than rows sharing
    the rows (the weights' partial sums); every backward kernel (``BACKWARD_KERNELS``)."""
    from model.attnres import attn_res_mix_norm, attn_res_mix_norm_grads

    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources, q, kw, ow, dh = _sources(S, D, torch.float32, S * 10 + D)
    got = mod.mix_norm_forward(q, kw, 1e-5, ow, 1e-6, *sources)
    assert got.shape == sources[0].shape and got.dtype == torch.float32
    assert_close("mix + norm", attn_res_mix_norm(q, kw, 1e-5, ow, 1e-6, *sources), got, 1e-6)
    want = attn_res_mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources)
    names = ["d query", "d key weight", "d out weight", *(f"d source {i}" for i in range(S))]
    for programs in (1, 3, 64):
        grads = mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources, programs=programs, kernel=kernel)
        assert len(grads) == 3 + S
        for name, w, g in zip(names, want, grads):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert_close(f"{name} ({programs} programs)", w, g, 2e-5 * float(w.abs().max()))


@pytest.mark.parametrize("kernel", ["tile", "passes", "rows"])
def test_learner_mix_norm_kernels_in_bf16_and_bad_input(monkeypatch, kernel):
    """bf16 sources: each output in its input's dtype, within bf16 rounding of the fp32 reference; a bf16 source
    among fp32 ones: the fp32 mix, each gradient in its source's dtype; more sources than the kernel takes and
    sources of two shapes are refused by name."""
    from model.attnres import attn_res_mix_norm, attn_res_mix_norm_grads

    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources, q, kw, ow, dh = _sources(4, 64, torch.bfloat16, 7)
    got = mod.mix_norm_forward(q, kw, 1e-5, ow, 1e-6, *sources)
    want = attn_res_mix_norm(q, kw, 1e-5, ow, 1e-6, *(s.float() for s in sources))
    assert got.dtype == torch.bfloat16
    assert_close("bf16 mix + norm", want, got.float(), 0.03 * float(want.abs().max()))
    grads = mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources, kernel=kernel)
    want = attn_res_mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh.float(), *(s.float() for s in sources))
    assert [g.dtype for g in grads] == [torch.float32] * 3 + [torch.bfloat16] * 4
    for w, g in zip(want, grads):
        assert_close("bf16 gradient", w, g.float(), 0.03 * float(w.abs().max()))
    with pytest.raises(ValueError, match="1 to 8 sources of one shape"):
        mod.mix_norm_forward(q, kw, 1e-5, ow, 1e-6, *([sources[0]] * 9))
    with pytest.raises(ValueError, match="1 to 8 sources of one shape"):
        mod.mix_norm_forward(q, kw, 1e-5, ow, 1e-6, sources[0], sources[1][:1])
    with pytest.raises(ValueError, match="backward kernel 'columns'"):
        mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources, kernel="columns")
    mixed = [sources[0], *(s.float() for s in sources[1:])]  # a bf16 source beside fp32 ones, as under autocast
    got = mod.mix_norm_forward(q, kw, 1e-5, ow, 1e-6, *mixed)
    assert got.dtype == torch.float32
    assert_close("mixed mix + norm", attn_res_mix_norm(q, kw, 1e-5, ow, 1e-6, *mixed), got, 1e-6)
    grads = mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh.float(), *mixed, kernel=kernel)
    want = attn_res_mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh.float(), *mixed)
    assert [g.dtype for g in grads[3:]] == [t.dtype for t in mixed]
    for w, g in zip(want, grads):  # the bf16 source's gradient within its own rounding
        assert_close("mixed gradient", w.float(), g.float(), 2e-5 if g.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kernel", ["tile", "passes", "rows"])
def test_the_learner_node_on_the_kernels_backpropagates_like_autograd(monkeypatch, kernel):
    """``model.attnres._MixNormNode`` with the Triton pair (what op "attn_res" = triton runs on CUDA) gives the
    gradients autograd takes through the reference mix and norm, fp32, to every source and weight."""
    from model.attnres import MixNormFns, _MixNormNode, attn_res_mix

    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources, q, kw, ow, dh = _sources(5, 32, torch.float32, 3, shape=(9,))
    leaves = [t.clone().requires_grad_() for t in (q, kw, ow, *sources)]
    ref = rms_norm(attn_res_mix(leaves[0], leaves[1], 1e-5, *leaves[3:]), leaves[2], 1e-6)
    want = torch.autograd.grad(ref, leaves, dh)
    fns = MixNormFns(mod.mix_norm_forward, functools.partial(mod.mix_norm_grads, kernel=kernel), adds_into=True)
    out = _MixNormNode.apply(fns, None, leaves[0], leaves[1], 1e-5, leaves[2], 1e-6, *leaves[3:])
    assert_close("node output", ref.detach(), out.detach(), 1e-6)
    for i, (w, g) in enumerate(zip(want, torch.autograd.grad(out, leaves, dh))):
        assert_close(f"gradient {i}", w, g, 2e-5)


@pytest.mark.parametrize("kernel", ["tile", "passes", "rows"])
def test_the_backward_adds_into_given_buffers_in_place(monkeypatch, kernel):
    """``into``: a source given a buffer gets its gradient added to it, in the buffer itself (fp32 sum, rounded once:
    within one bf16 rounding of the two-step sum), the others new; mixed dtypes, as the learner's first source is
    fp32 beside bf16 block sums."""
    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources, q, kw, ow, dh = _sources(4, 32, torch.bfloat16, 7, shape=(9,))
    sources[0] = sources[0].float()
    fresh = mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources, programs=3, kernel=kernel)
    gen = torch.Generator().manual_seed(1)
    held = [None, torch.randn(9, 32, generator=gen).to(torch.bfloat16), None, torch.randn(9, 32, generator=gen)]
    held[3] = held[3].to(torch.bfloat16)
    before = [None if b is None else b.clone() for b in held]
    got = mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources, programs=3, kernel=kernel, into=held)
    for i, (f, g, b) in enumerate(zip(fresh[3:], got[3:], before)):
        assert g.dtype == sources[i].dtype and g.shape == sources[i].shape
        if b is None:
            assert torch.equal(f, g)
            continue
        assert g.data_ptr() == held[i].data_ptr()  # the buffer itself
        assert_close(f"source {i} added into", b.float() + f.float(), g.float(), 1e-2)
    for f, g in zip(fresh[:3], got[:3]):  # the weights' gradients do not depend on the buffers
        assert torch.equal(f, g)


def test_the_backward_names_a_bad_buffer(monkeypatch):
    mod = _interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sources, q, kw, ow, dh = _sources(2, 16, torch.float32, 3, shape=(5,))
    with pytest.raises(ValueError, match="one entry per source"):
        mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources, into=[None])
    with pytest.raises(ValueError, match=r"into\[1\] must be contiguous"):
        mod.mix_norm_grads(q, kw, 1e-5, ow, 1e-6, dh, *sources, into=[None, torch.zeros(5, 16, dtype=torch.bfloat16)])


def _block_chain(fns, shared, leaves, layers: int = 6, block: int = 2):
    """A Block AttnRes wiring (``model.modeling.HybridModel._forward_attn_res``) of mix-and-norm nodes with
    tanh sub-layers: a completed block is a source of every later mix, each mix's newest source the running sum
    after the previous mix's sub-layer; one mix reads the embedding twice. ``leaves``: (embedding, query, key
    weight, out weight)."""
    from model.attnres import _MixNormNode

    emb, q, kw, ow = leaves
    blocks, partial = [emb], torch.tanh(emb * 0.7)
    for l in range(1, layers):
        sources = [*blocks, partial, emb] if l == 3 else [*blocks, partial]  # one mix reads a source twice
        x = _MixNormNode.apply(fns, shared, q * (1 + 0.1 * l), kw, 1e-5, ow, 1e-6, *sources)
        a = torch.tanh(x * (0.5 + 0.05 * l))
        if l % block == 0:
            blocks.append(partial)
            partial = a
        else:
            partial = partial + a
    return _MixNormNode.apply(fns, shared, q, kw, 1e-5, ow, 1e-6, *blocks, partial)


@pytest.mark.parametrize("on_kernels", [False, True])
def test_shared_source_gradients_equal_autograd_summing_them(monkeypatch, on_kernels):
    """``model.attnres.SharedSourceGrads`` (later mixes add a shared source's gradient into one buffer, its earliest
    mix returns it) against every mix handing autograd its own, to fp32 rounding: the PyTorch node (the sums of the
    source read twice come in another order; the whole model's wiring, where no mix reads a source twice, is bit
    for bit: tests/model/test_fast_paths.py) and the Triton node (adding in the kernel, interpreted); a second
    backward of the same graph (``retain_graph``) gives the same again."""
    from model.attnres import MixNormFns, SharedSourceGrads, attn_res_mix_norm, attn_res_mix_norm_grads

    if on_kernels:
        mod = _interpreted()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        fns = MixNormFns(mod.mix_norm_forward, functools.partial(mod.mix_norm_grads, programs=2), adds_into=True)
    else:
        fns = MixNormFns(attn_res_mix_norm, attn_res_mix_norm_grads)
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(2, 6, 16, generator=gen)] + [torch.randn(16, generator=gen) for _ in range(3)]

    def grads(shared, twice: bool = False):
        leaves = [t.clone().requires_grad_() for t in base]
        out = _block_chain(fns, shared, leaves)
        dh = torch.linspace(-1, 1, out.numel()).view_as(out)
        first = torch.autograd.grad(out, leaves, dh, retain_graph=twice)
        return (first, torch.autograd.grad(out, leaves, dh)) if twice else first

    want = grads(None)
    got, again = grads(SharedSourceGrads(), twice=True)
    for name, w, g, g2 in zip(("embedding", "query", "key weight", "out weight"), want, got, again):
        assert_close(name, w, g, 1e-5 if on_kernels else 1e-6)
        assert torch.equal(g, g2), name


def test_every_triton_op_choice_names_a_backward_kernel():
    """``model.fast`` op "attn_res" choices on the Triton node map to kernels the module has."""
    from model import fast
    from model.attnres import TRITON_BACKWARDS

    mod = _interpreted()
    assert set(TRITON_BACKWARDS) <= set(fast.CHOICES["attn_res"])
    assert set(TRITON_BACKWARDS.values()) == set(mod.BACKWARD_KERNELS)
