"""KDA layer: gate bounds, cached decode == full forward, packed == padded, conv == F.conv1d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_cases import tiny_config

from model.cache import KDAState
from model.kda import KimiDeltaAttention, kda_gate
from model.layers import ShortConvolution, final_state_reference, seq_layout


def make_layer(**overrides) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(tiny_config(**overrides), layer_idx=0).double()
    for p in layer.parameters():  # nonzero everywhere, so every path matters
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.3)
    return layer


def run(layer, x, cu_seqlens=None, state=None):
    layout = seq_layout(x.shape[0], x.shape[1], cu_seqlens, x.device)
    return layer(x, layout, cu_seqlens, state, return_state=True)


def test_bounded_gate_stays_in_range_and_unbounded_does_not():
    z = torch.randn(4, 64, 2, 16) * 50  # far into saturation on both sides
    A_log = torch.tensor([-3.0, 4.0])
    g = kda_gate(z, A_log, "bounded", -5.0)
    assert g.dtype == torch.float32
    assert bool((g >= -5.0).all()) and bool((g <= 0.0).all())
    assert float(g.min()) == pytest.approx(-5.0, abs=1e-3)
    g_free = kda_gate(z, A_log, "unbounded", -5.0)
    assert float(g_free.min()) < -100.0  # the unbounded form has no floor


def test_layer_decay_bounded_at_init_and_for_large_inputs():
    layer = KimiDeltaAttention(tiny_config(), 0)
    assert torch.equal(layer.A_log.detach(), torch.zeros(2))  # K3: A initialised to 0
    x = torch.randn(2, 10, 64) * 100
    g, _beta = layer.gates(x)
    assert bool((g >= -5.0).all()) and bool((g <= 0.0).all())


def test_model_init_follows_k3():
    from model.modeling import HybridForCausalLM

    model = HybridForCausalLM(tiny_config())
    kda = [layer.self_attn for layer in model.model.layers if layer.is_kda]
    assert kda
    for layer in kda:
        assert torch.equal(layer.A_log.detach(), torch.zeros_like(layer.A_log))
        dt = F.softplus(layer.dt_bias.detach())
        assert float(dt.min()) >= 1e-3 * (1 - 1e-4) and float(dt.max()) <= 0.1 * (1 + 1e-4)
        assert float(dt.std()) > 0  # log-uniform draws, not a constant


def test_short_convolution_matches_conv1d():
    conv = ShortConvolution(6, 4, activation=None).double()
    x = torch.randn(3, 11, 6, dtype=torch.float64)
    y, state = conv(x, seq_layout(3, 11, None, x.device))
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, groups=6).transpose(1, 2)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))


@pytest.mark.parametrize("K", [4, 2, 1])
@pytest.mark.parametrize("with_state", [True, False])
def test_final_conv_states_equal_the_per_sequence_reference(K, with_state):
    """The final conv states gathered for all sequences at once equal the per-sequence concatenation, exactly:
    packed sequences shorter than the window (lengths 0, 1, 2: partly or wholly from the conv state), at it,
    and longer (15, 64, 65, 300), and a padded batch."""
    gen = torch.Generator().manual_seed(K)
    conv = ShortConvolution(5, K)
    lengths = [1, 0, 2, 3, 15, 64, 65, 300]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(1, sum(lengths), 5, generator=gen)
    state = torch.randn(len(lengths), 5, K - 1, generator=gen) if with_state else None
    for x_BTC, layout, s in ((x, seq_layout(1, x.shape[1], cu, "cpu"), state),
                             (x[0, :96].view(3, 32, 5), seq_layout(3, 32, None, "cpu"), None if state is None else state[:3])):  # fmt: skip
        got = conv._final_state(x_BTC, layout, s)
        assert got.shape == (layout.num_seqs, 5, K - 1)
        assert torch.equal(got, final_state_reference(x_BTC, layout, s, K - 1))


def test_token_by_token_decode_equals_full_forward():
    layer = make_layer()
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    y_full, s_full = run(layer, x)
    state, ys = None, []
    for t in range(9):
        y_t, state = run(layer, x[:, t : t + 1], state=state)
        ys.append(y_t)
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(state.recurrent_NHKV, s_full.recurrent_NHKV, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(state.conv_q_NCW, s_full.conv_q_NCW)


def test_chunked_prefill_with_state_equals_full_forward():
    layer = make_layer()
    x = torch.randn(1, 20, 64, dtype=torch.float64)
    y_full, _ = run(layer, x)
    y_a, state = run(layer, x[:, :7])
    y_b, _ = run(layer, x[:, 7:], state=state)  # multi-token continuation: chunked kernel + states
    torch.testing.assert_close(torch.cat([y_a, y_b], 1), y_full, rtol=1e-9, atol=1e-10)


def test_packed_varlen_equals_padded_separately():
    layer = make_layer()
    lengths = [5, 1, 9]
    xs = [torch.randn(1, n, 64, dtype=torch.float64) for n in lengths]
    init = KDAState(
        torch.randn(3, 2, 16, 16, dtype=torch.float64),
        *(torch.randn(3, 32, 3, dtype=torch.float64) for _ in range(3)),
    )
    cu = torch.tensor([0, 5, 6, 15])
    y_packed, s_packed = run(layer, torch.cat(xs, 1), cu_seqlens=cu, state=init)
    for n, x in enumerate(xs):
        one = KDAState(*(t[n : n + 1] for t in vars(init).values()))
        y, s = run(layer, x, state=one)
        torch.testing.assert_close(y_packed[:, cu[n] : cu[n + 1]], y, rtol=1e-9, atol=1e-10)
        for a, b in zip(vars(s_packed).values(), vars(s).values()):
            torch.testing.assert_close(a[n : n + 1], b, rtol=1e-9, atol=1e-10)


def test_unbounded_gate_layer_runs_through_the_recurrent_kernel():
    layer = make_layer(kda_gate="unbounded")
    assert float(layer.A_log.detach().exp().min()) >= 1.0 - 1e-6  # Kimi Linear init: A in [1, 16]
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    y, _ = run(layer, x)
    assert torch.isfinite(y).all()


def test_bf16_layer_stays_finite_with_gate_saturated_for_thousands_of_tokens():
    layer = KimiDeltaAttention(tiny_config(), 0).to(torch.bfloat16)
    with torch.no_grad():
        layer.dt_bias.fill_(100.0)  # sigmoid(z) -> 1: every step decays by the floor e^-5
    x = torch.randn(1, 2048, 64, dtype=torch.bfloat16)
    g = layer.gates(x)[0].detach()
    assert float(g.min()) == pytest.approx(-5.0, abs=1e-3)
    y, state = run(layer, x)
    assert torch.isfinite(y).all() and torch.isfinite(state.recurrent_NHKV).all()


def test_a_static_layout_fixes_the_kernels_shapes_by_token_and_sequence_count():
    """``seq_layout(static=True)`` (a learner under CUDA graphs): varlen attention's longest length is T and the KDA
    layers' chunk plan is padded to ``padded_chunk_count`` whatever the lengths, with empty chunks after the last
    sequence's end; the plain layout keeps the exact ones."""
    pytest.importorskip("triton")
    from kernels.kda.triton.common import BT, padded_chunk_count
    from model.kda import _layout_plan

    T = 3 * BT
    for lengths in ([1, BT + 1, 2 * BT - 2, 0], [3 * BT - 2, 1, 1, 0]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        plain, static = seq_layout(1, T, cu, "cpu"), seq_layout(1, T, cu, "cpu", static=True)
        assert plain.max_len == max(lengths) and static.max_len == T and static.static and not plain.static
        exact = sum(-(-n // BT) for n in lengths)
        assert _layout_plan(plain, 1, T, cu, torch.device("cpu")).num_chunks == exact
        padded = _layout_plan(static, 1, T, cu, torch.device("cpu"))
        assert padded.num_chunks == padded_chunk_count(T, len(lengths)) == 3 + len(lengths) > exact
        ci = padded.chunk_indices_C2.tolist()
        starts = [cu[n].item() + c * BT for n, c in ci]
        assert all(s >= T for s in starts[exact:]) and all(s < cu[n + 1] for (n, _), s in zip(ci[:exact], starts))
