"""Block AttnRes: uniform mixing at init, softmax over RMS-normed keys, exact wiring."""

from __future__ import annotations

import pytest
import torch
from model_cases import tiny_config

from model.attnres import AttnResMix
from model.modeling import HybridForCausalLM


def test_zero_query_mixes_uniformly_and_values_are_not_normalised():
    mix = AttnResMix(8)
    sources = [torch.randn(2, 3, 8) * s for s in (1.0, 10.0, 0.1)]
    torch.testing.assert_close(mix(sources), sum(sources) / 3)


def test_learned_query_is_softmax_over_normed_keys():
    mix = AttnResMix(8)
    with torch.no_grad():
        mix.query.copy_(torch.randn(8))
        mix.norm.weight.copy_(torch.rand(8) + 0.5)
    v = [torch.randn(4, 8) for _ in range(3)]
    logits = torch.stack([(mix.norm(s) * mix.query).sum(-1) for s in v])  # [S, 4]
    a = logits.softmax(0)
    torch.testing.assert_close(mix(v), sum(a[i][:, None] * v[i] for i in range(3)))
    mix(v).sum().backward()
    assert mix.query.grad is not None and float(mix.query.grad.abs().sum()) > 0


def test_model_wiring_at_init_is_uniform_mixing_of_blocks():
    """Re-derive the Block AttnRes forward by hand with uniform means and compare."""
    model = HybridForCausalLM(tiny_config(attn_res_block_size=2)).double().eval()
    assert all(float(m.query.detach().abs().sum()) == 0 for m in model.modules() if isinstance(m, AttnResMix))
    ids = torch.randint(0, 128, (1, 7))
    layers, emb = model.model.layers, model.model.embed_tokens(ids)

    def attn(layer, x):
        return layer.self_attn(layer.input_layernorm(x), _layout(x), None, None, False)[0]

    def ffn(layer, x):
        return layer.ffn(layer.post_attention_layernorm(x), None)[0]

    def mean(xs):
        return sum(xs) / len(xs)

    # block 1 = layers 0, 1; block 2 = layers 2, 3; sources: embedding, completed blocks, partial sum
    a0 = attn(layers[0], emb)
    p = a0 + ffn(layers[0], mean([emb, a0]))
    a1 = attn(layers[1], mean([emb, p]))
    p = p + a1
    b1 = p + ffn(layers[1], mean([emb, p]))
    a2 = attn(layers[2], mean([emb, b1]))
    p = a2 + ffn(layers[2], mean([emb, b1, a2]))
    a3 = attn(layers[3], mean([emb, b1, p]))
    p = p + a3
    p = p + ffn(layers[3], mean([emb, b1, p]))
    out = mean([emb, b1, p])
    expected = model.lm_head(model.model.norm(out))
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-10, atol=1e-12)


def _layout(x):
    from model.layers import seq_layout

    return seq_layout(x.shape[0], x.shape[1], None, x.device)


def test_mix_and_norm_as_one_region_equal_the_two_modules():
    """``AttnResMix.normed`` gives ``norm(mix(sources))`` bit for bit forward (fp64) on every fast-path pair, and
    backward too on all but the learner's default ("fused": one node whose gradient is the closed form
    ``attn_res_mix_norm_grads``, equal to autograd's to fp64 rounding)."""
    from model import fast
    from model.fast import use_fast_paths
    from model.layers import RMSNorm

    torch.manual_seed(0)
    mix, norm = AttnResMix(8).double(), RMSNorm(8).double()
    with torch.no_grad():
        for p in (mix.query, mix.norm.weight, norm.weight):
            p.copy_(torch.rand(8, dtype=torch.float64) + 0.5)
    sources = [torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    params = [*sources, mix.query, mix.norm.weight, norm.weight]

    def run(fn):
        out = fn()
        return out.detach(), torch.autograd.grad((out * out.detach().cos()).sum(), params)

    with use_fast_paths("reference"):
        want, want_grads = run(lambda: norm(mix(sources)))
    for spec in ("auto", "attn_res=recompute", "attn_res=torch", "norm=torch", "reference"):
        with use_fast_paths(spec):
            got, grads = run(lambda: mix.normed(sources, norm))
            tol = 1e-12 if fast.pick("attn_res", got.device) == "fused" else 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _mix_case(S: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    D = 24
    weights = [(torch.rand(D, generator=g, dtype=torch.float64) + 0.5).requires_grad_() for _ in range(3)]
    sources = [(torch.randn(3, 7, D, generator=g, dtype=torch.float64) * (i + 1)).to(dtype).requires_grad_()
               for i in range(S)]  # fmt: skip
    return weights, sources, torch.randn(3, 7, D, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("S", [2, 3, 6])
def test_closed_form_mix_norm_gradient_equals_autograd(S):
    """``attn_res_mix_norm_grads`` against autograd on ``attn_res_mix_norm`` (fp64, 1e-12): every source, the
    query, the key norm's weight and the output norm's weight, with distinct eps for the two norms."""
    from model.attnres import attn_res_mix_norm, attn_res_mix_norm_grads

    (query, kw, ow), sources, dh = _mix_case(S)
    out = attn_res_mix_norm(query, kw, 1e-3, ow, 1e-5, *sources)
    want = torch.autograd.grad(out, [query, kw, ow, *sources], dh)
    got = attn_res_mix_norm_grads(query, kw, 1e-3, ow, 1e-5, dh, *sources)
    assert len(got) == len(want) == 3 + S
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)


def test_closed_form_mix_norm_gradient_fails_on_a_wrong_eps():
    """The comparison can fail: the two norms' eps swapped."""
    from model.attnres import attn_res_mix_norm, attn_res_mix_norm_grads

    (query, kw, ow), sources, dh = _mix_case(3, seed=1)
    out = attn_res_mix_norm(query, kw, 0.5, ow, 1e-5, *sources)
    want = torch.autograd.grad(out, [query, kw, ow, *sources], dh)
    got = attn_res_mix_norm_grads(query, kw, 1e-5, ow, 0.5, dh, *sources)
    with pytest.raises(AssertionError):
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)


def test_mix_norm_node_in_bf16_is_as_accurate_as_autograd():
    """bf16 sources (the learner under autocast) with fp32 weights: the node's gradients (bf16 sources, fp32
    weights) are at least as close to the fp64 ones as autograd's through the checkpointed region."""
    from kernels.testing import error_ratio
    from model.fast import use_fast_paths
    from model.layers import RMSNorm

    (query, kw, ow), sources64, dh64 = _mix_case(4, seed=2)
    results = {}
    for name, spec, dtype in (("exact", "attn_res=recompute", torch.float64), ("checkpoint", "attn_res=recompute",
                              torch.bfloat16), ("node", "auto", torch.bfloat16)):  # fmt: skip
        m, n = AttnResMix(24).to(dtype if dtype == torch.float64 else torch.float32), RMSNorm(24)
        n = n.to(m.query.dtype)
        with torch.no_grad():
            m.query.copy_(query), m.norm.weight.copy_(kw), n.weight.copy_(ow)
        srcs = [s.detach().to(dtype).requires_grad_() for s in sources64]
        with use_fast_paths(spec):
            out = m.normed(srcs, n)
        params = [m.query, m.norm.weight, n.weight, *srcs]
        results[name] = torch.autograd.grad(out, params, dh64.to(out.dtype))
    assert [g.dtype for g in results["node"]] == [torch.float32] * 3 + [torch.bfloat16] * 4
    for i, (exact, old, new) in enumerate(zip(*results.values())):
        err_old, err_new = error_ratio(exact, old), error_ratio(exact, new)
        assert err_new <= 1.25 * err_old + 1e-3, f"gradient {i}: node {err_new:.2e} vs checkpoint {err_old:.2e}"


def _served_tiny_model(seed: int):
    """A tiny model prepared for serving on the CPU (its mixes on no CUDA kernel: the compiled stacked mix, then the
    norm) with learned-looking queries, a batch of ids and its logits: (model, mixes, ids, logits)."""
    from model.serving import prepare_for_serving

    torch.manual_seed(seed)
    model = HybridForCausalLM(tiny_config(num_hidden_layers=6, attn_res_block_size=2, routed_expert_hidden_size=32))
    prepare_for_serving(model, 64)
    mixes = [m for m in model.modules() if isinstance(m, AttnResMix)]
    assert mixes and all(m.sources_mix_norm_fn is None for m in mixes)
    with torch.no_grad():
        for m in mixes:
            m.query.copy_(torch.randn_like(m.query))
        ids = torch.randint(0, 128, (1, 29))
        return model, mixes, ids, model(ids).logits


def test_served_mixes_on_the_engine_kernel_give_the_model_logits(monkeypatch):
    """An engine's mixes (``prepare_for_serving``) with ``sources_mix_norm_fn`` on the stacked sources' one-kernel mix
    and norm (here the Triton kernel interpreted on the CPU) give the logits of the stacked mix and the norm one
    after the other (fp32, learned queries); ``model.fast``'s reference choice turns the kernel off."""
    import pytest

    pytest.importorskip("triton")
    from kernels.testing import import_interpreted
    from model.fast import use_fast_paths

    kernel = import_interpreted("kernels.attnres.triton")[0].mix_norm_rows
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, mixes, ids, want = _served_tiny_model(seed=0)
    with torch.no_grad():
        calls = []
        for m in mixes:
            m.sources_mix_norm_fn = lambda *a: calls.append(len(a) - 5) or kernel(*a[:5], torch.stack(a[5:]))
        got = model(ids).logits
        assert len(calls) >= len(mixes) and max(calls) >= 3  # every mix of 2+ sources took the kernel
        calls.clear()
        with use_fast_paths("reference"):
            model(ids)
        assert calls == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_served_mixes_read_their_sources_where_they_are(monkeypatch):
    """An engine's mixes with ``sources_mix_norm_fn`` as CUDA engines get it (the learner's forward kernel over the
    unstacked sources, here interpreted on the CPU) give the logits of the stacked mix and the norm one after the
    other (fp32); past ``MAX_SOURCES`` sources the function stacks them for the stacked kernel, equal to it."""
    import pytest

    pytest.importorskip("triton")
    from kernels.attnres import attn_res_mix_norm_sources_triton
    from kernels.testing import import_interpreted

    interp = import_interpreted("kernels.attnres.triton")[0]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, mixes, ids, want = _served_tiny_model(seed=1)
    with torch.no_grad():
        calls = []
        for m in mixes:
            m.sources_mix_norm_fn = lambda *a: calls.append(len(a) - 5) or attn_res_mix_norm_sources_triton(*a)
        got = model(ids).logits
    assert len(calls) >= len(mixes) and max(calls) >= 3  # every mix of 2+ sources, unstacked
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = (torch.randn(16), torch.rand(16) + 0.5, 1e-5, torch.rand(16) + 0.5, 1e-5)
    many = [torch.randn(5, 16) for _ in range(interp.MAX_SOURCES + 1)]
    torch.testing.assert_close(attn_res_mix_norm_sources_triton(*weights, *many),
                               interp.mix_norm_rows(*weights, torch.stack(many)), rtol=0, atol=0)  # fmt: skip
