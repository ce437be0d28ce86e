"""Gated NoPE MLA: absorbed (latent cache) == expanded; packed == padded; cached decode."""

from __future__ import annotations

import torch
from model_cases import tiny_config

from model.layers import seq_layout
from model.mla import GatedMLA


def make_layer(**overrides) -> GatedMLA:
    layer = GatedMLA(tiny_config(**overrides), layer_idx=3).double()
    for p in layer.parameters():
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.3)
    return layer


def run(layer, x, cu_seqlens=None, state=None, absorbed=None):
    layout = seq_layout(x.shape[0], x.shape[1], cu_seqlens, x.device)
    return layer(x, layout, cu_seqlens, state, return_state=True, absorbed=absorbed)


def test_absorbed_equals_expanded_on_prefill_and_packed():
    for q_lora_rank in (None, 24):
        layer = make_layer(q_lora_rank=q_lora_rank)
        x = torch.randn(1, 12, 64, dtype=torch.float64)
        cu = torch.tensor([0, 4, 12])
        y_exp, _ = run(layer, x, cu, absorbed=False)
        y_abs, _ = run(layer, x, cu, absorbed=True)
        torch.testing.assert_close(y_abs, y_exp, rtol=1e-10, atol=1e-12)


def test_cached_decode_absorbed_equals_full_expanded():
    layer = make_layer()
    x = torch.randn(2, 8, 64, dtype=torch.float64)
    y_full, s_full = run(layer, x, absorbed=False)
    y0, state = run(layer, x[:, :3], absorbed=False)
    ys = [y0]
    for t in range(3, 8):
        y_t, state = run(layer, x[:, t : t + 1], state=state)  # default: absorbed over the cache
        ys.append(y_t)
    torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-10, atol=1e-12)
    assert state.c_kv_NSR.shape == (2, 8, 32) and state.k_pe_NSP.shape == (2, 8, 8)  # latent cache only
    torch.testing.assert_close(state.c_kv_NSR, s_full.c_kv_NSR)


def test_packed_equals_padded_and_no_cross_sequence_attention():
    layer = make_layer()
    a, b = torch.randn(1, 5, 64, dtype=torch.float64), torch.randn(1, 7, 64, dtype=torch.float64)
    y_packed, _ = run(layer, torch.cat([a, b], 1), torch.tensor([0, 5, 12]))
    torch.testing.assert_close(y_packed[:, :5], run(layer, a)[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y_packed[:, 5:], run(layer, b)[0], rtol=1e-10, atol=1e-12)


def test_causal_and_gated():
    layer = make_layer()
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 4:] += 1.0  # changing later tokens must not change earlier outputs
    y, y2 = run(layer, x)[0], run(layer, x2)[0]
    torch.testing.assert_close(y[:, :4], y2[:, :4])
    assert not torch.allclose(y[:, 4:], y2[:, 4:])
    with torch.no_grad():
        layer.g_proj.weight.fill_(0.0)  # gate = 0.5 everywhere: output halves
    ungated = make_layer(mla_use_output_gate=False)
    ungated.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("g_proj")})
    torch.testing.assert_close(run(layer, x)[0], 0.5 * run(ungated, x)[0])


def test_absorbed_weights_view_a_plain_projection_and_read_a_wrapped_one_through_it():
    """W_UK / W_UV of a plain kv_b_proj are views of its weight (nothing computed a decode step; an in-place update
    shows at once) equal to reading the module through an identity; under a LoRA wrapper the identity read, which
    includes the adapter's update."""
    from peft import LoraConfig, get_peft_model

    layer = make_layer()
    R, H = layer.kv_lora_rank, layer.num_heads
    like = torch.zeros((), dtype=torch.float64)
    w_uk, w_uv = layer.absorbed_weights(like)
    via_eye = layer.kv_b_proj(torch.eye(R, dtype=torch.float64)).T.reshape(H, layer.nope + layer.v_dim, R)
    assert torch.equal(w_uk, via_eye[:, : layer.nope]) and torch.equal(w_uv, via_eye[:, layer.nope :])
    assert w_uk.untyped_storage().data_ptr() == layer.kv_b_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        layer.kv_b_proj.weight.mul_(2)
    assert torch.equal(w_uk, 2 * via_eye[:, : layer.nope])

    wrapped = get_peft_model(torch.nn.Sequential(layer), LoraConfig(r=2, target_modules=["kv_b_proj"]))
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a non-zero adapter update
    inner = wrapped.base_model.model[0]
    got_uk, _ = inner.absorbed_weights(like)
    want = inner.kv_b_proj(torch.eye(R, dtype=torch.float64)).T.reshape(H, layer.nope + layer.v_dim, R)
    assert torch.equal(got_uk, want[:, : layer.nope])
    assert not torch.allclose(got_uk, 2 * via_eye[:, : layer.nope])  # the adapter counts
