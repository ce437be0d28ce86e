"""Causal LM invariants: cached decode == full forward, packed == padded, save/load bit-exact,
routing replay, per-token logprobs, generate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_cases import tiny_config

from model.modeling import HybridForCausalLM, token_logprobs


def make_model(dtype=torch.float64, **overrides) -> HybridForCausalLM:
    model = HybridForCausalLM(tiny_config(**overrides)).to(dtype).eval()
    with torch.no_grad():  # move AttnRes off uniform mixing so its wiring matters too
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(std=0.5)
    return model


@pytest.mark.parametrize("attn_res_block_size", [2, 0])
def test_incremental_decode_equals_full_forward(attn_res_block_size):
    model = make_model(attn_res_block_size=attn_res_block_size)
    ids = torch.randint(0, 128, (2, 10))
    full = model(ids).logits
    out = model(ids[:, :4], use_cache=True)  # prefill 4, then one token at a time
    logits = [out.logits]
    for t in range(4, 10):
        out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-9, atol=1e-9)
    assert out.past_key_values.get_seq_length() == 10


def test_cache_select_keeps_rows():
    model = make_model()
    ids = torch.randint(0, 128, (3, 6))
    out = model(ids[:, :5], use_cache=True)
    kept = out.past_key_values.select(torch.tensor([2, 0]))
    step = model(ids[[2, 0], 5:], past_key_values=kept, use_cache=True).logits
    torch.testing.assert_close(step, model(ids[[2, 0]]).logits[:, 5:], rtol=1e-9, atol=1e-9)


def test_packed_varlen_equals_padded():
    model = make_model()
    seqs = [torch.randint(0, 128, (1, n)) for n in (6, 3, 11)]
    cu = torch.tensor([0, 6, 9, 20])
    packed = torch.cat(seqs, 1)
    out = model(packed, cu_seqlens=cu, labels=packed, target_ids=packed.roll(-1, 1))
    losses, counts = [], []
    for n, ids in enumerate(seqs):
        alone = model(ids, labels=ids)
        torch.testing.assert_close(out.logits[:, cu[n] : cu[n + 1]], alone.logits, rtol=1e-9, atol=1e-9)
        losses.append(alone.loss * (ids.shape[1] - 1))
        counts.append(ids.shape[1] - 1)
    torch.testing.assert_close(out.loss, sum(losses) / sum(counts))  # no prediction across boundaries


def test_batched_padded_rows_are_independent():
    model = make_model()
    ids = torch.randint(0, 128, (3, 7))
    batched = model(ids).logits
    for b in range(3):
        torch.testing.assert_close(batched[b : b + 1], model(ids[b : b + 1]).logits, rtol=1e-9, atol=1e-9)


def test_token_logprobs_match_log_softmax():
    model = make_model(torch.float32)
    ids = torch.randint(0, 128, (2, 9))
    targets = torch.randint(0, 128, (2, 9))
    out = model(ids, target_ids=targets)
    ref = F.log_softmax(out.logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out.token_logprobs, ref)
    torch.testing.assert_close(token_logprobs(out.logits, targets, chunk=4), ref)


def test_logprobs_without_logits_match_and_backprop_the_same():
    model = make_model(torch.float32)
    ids, targets = torch.randint(0, 128, (1, 20)), torch.randint(0, 128, (1, 20))
    full = model(ids, target_ids=targets)
    full.token_logprobs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    from model import modeling

    lean = model(ids, target_ids=targets, return_logits=False)
    assert lean.logits is None
    torch.testing.assert_close(lean.token_logprobs, full.token_logprobs)
    small = modeling.chunked_token_logprobs(model.lm_head, lean.hidden_states, targets, chunk=7)
    torch.testing.assert_close(small, full.token_logprobs)
    lean.token_logprobs.sum().backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="target_ids"):
        model(ids, return_logits=False)


def test_routing_replay_uses_given_experts():
    model = make_model(torch.float32)
    ids = torch.randint(0, 128, (2, 8))
    own = model(ids, output_router_choices=True)
    n_moe, k = len(model.config.moe_layer_indices), model.config.num_experts_per_token
    assert own.router_choices.shape == (16, n_moe, k)
    same = model(ids, routed_experts=own.router_choices, output_router_choices=True)
    torch.testing.assert_close(same.logits, own.logits, rtol=0, atol=0)
    forced = torch.stack([torch.randperm(8)[:k] for _ in range(16 * n_moe)]).view(16, n_moe, k)
    replayed = model(ids, routed_experts=forced, output_router_choices=True)
    assert torch.equal(replayed.router_choices, forced)
    assert not torch.allclose(replayed.logits, own.logits)
    with pytest.raises(ValueError, match="routed_experts"):
        model(ids, routed_experts=forced[:, :1])


def test_tokens_replayed_as_minus_one_are_routed_freely_in_the_same_forward():
    """A -1 row routes that token by the router, given the replayed context: with the model's own
    choices elsewhere nothing changes; with forced experts elsewhere the -1 tokens take their top-k of
    that forward, so replaying what it reports reproduces it exactly."""
    model = make_model(torch.float32)
    ids = torch.randint(0, 128, (2, 8))
    own = model(ids, output_router_choices=True)
    n_moe, k = len(model.config.moe_layer_indices), model.config.num_experts_per_token
    partial = own.router_choices.clone()
    partial[::3] = -1
    same = model(ids, routed_experts=partial)
    torch.testing.assert_close(same.logits, own.logits, rtol=0, atol=0)
    forced = torch.stack([torch.randperm(8)[:k] for _ in range(16 * n_moe)]).view(16, n_moe, k)
    forced[5:] = -1  # tokens 5.. of the first row and the whole second row route freely
    mixed = model(ids, routed_experts=forced, output_router_choices=True)
    assert torch.equal(mixed.router_choices[:5], forced[:5])
    assert bool((mixed.router_choices[5:] >= 0).all())
    again = model(ids, routed_experts=mixed.router_choices)
    torch.testing.assert_close(again.logits, mixed.logits, rtol=0, atol=0)
    half = forced.clone()
    half[0, 0, 0] = -1  # one of a token's k experts only
    with pytest.raises(ValueError, match=r"all -1 .* or none of them"):
        model(ids, routed_experts=half)
    with pytest.raises(ValueError, match=r"must lie in \[0, 8\), or be -1"):
        model(ids, routed_experts=torch.full_like(forced, -2))


def test_replayed_routes_are_checked_once_at_the_first_moe_layer(monkeypatch):
    """The host's id check (and copy) of the replayed table waits for the first MoE layer, so the layers before it
    are queued on the device first; it runs once a forward, bad ids still fail, and the output is unchanged."""
    import model.modeling as modeling

    model = make_model(torch.float32, first_k_dense_replace=1)
    first_moe = model.config.moe_layer_indices[0]
    assert first_moe >= 1
    ids = torch.randint(0, 128, (2, 8))
    own = model(ids, output_router_choices=True)
    events: list[str] = []
    check = modeling.check_replay_ids
    monkeypatch.setattr(modeling, "check_replay_ids", lambda *a: (events.append("check"), check(*a))[1])
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(lambda *_, i=i: events.append(f"attn{i}"))
    same = model(ids, routed_experts=own.router_choices)
    torch.testing.assert_close(same.logits, own.logits, rtol=0, atol=0)
    assert events.count("check") == 1
    assert events.index("check") == events.index(f"attn{first_moe}") + 1  # after every layer before its MoE block
    bad = own.router_choices.clone()
    bad[-1, -1, 0] = model.config.num_experts
    with pytest.raises(ValueError, match="must lie in"):
        model(ids, routed_experts=bad)


def test_routes_may_leave_out_the_filler_rows():
    """With ``filler_tokens``, routes for the other tokens only give the forward of routes whose filler rows are -1
    (routed freely); any other row count is an error naming both accepted ones."""
    model = make_model(torch.float32)
    ids = torch.randint(0, 128, (1, 16))
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    own = model(ids, cu_seqlens=cu, output_router_choices=True).router_choices
    padded = own.clone()
    padded[12:] = -1
    want = model(ids, cu_seqlens=cu, routed_experts=padded, filler_tokens=4, output_router_choices=True)
    got = model(ids, cu_seqlens=cu, routed_experts=own[:12], filler_tokens=4, output_router_choices=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert torch.equal(got.router_choices, want.router_choices)
    with pytest.raises(ValueError, match=r"B\*T or B\*T - filler_tokens = 12"):
        model(ids, cu_seqlens=cu, routed_experts=own[:11], filler_tokens=4)
    with pytest.raises(ValueError, match="routed_experts must be"):
        model(ids, cu_seqlens=cu, routed_experts=own[:12])  # no filler named


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip_is_bit_exact(tmp_path, tie):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = make_model(torch.float32, tie_word_embeddings=tie)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.gate.e_score_correction_bias.normal_()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "longhorizon_hybrid"
    for loader in (HybridForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path).eval()
        assert isinstance(loaded, HybridForCausalLM)
        want, got = model.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
        shared = loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        assert shared == tie
        ids = torch.randint(0, 128, (1, 9))
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_generate_greedy_matches_repeated_full_forward():
    model = make_model(torch.float32)
    prompt = torch.randint(0, 128, (2, 5))
    out = model.generate(prompt, max_new_tokens=6)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    eos = int(out[0, 5])
    stopped = model.generate(prompt[:1], max_new_tokens=6, eos_token_id=eos)
    assert stopped.shape == (1, 6) and int(stopped[0, -1]) == eos
    sampled = model.generate(prompt, max_new_tokens=3, do_sample=True, temperature=0.7)
    assert sampled.shape == (2, 8)


def test_bad_inputs_raise_clear_errors():
    model = make_model(torch.float32)
    ids = torch.randint(0, 128, (2, 6))
    with pytest.raises(ValueError, match="batch size 1"):
        model(ids, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids[:1], cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="padding"):
        model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]] * 2))
    with pytest.raises(TypeError, match="unexpected"):
        model(ids, position_ids=ids)


def test_bf16_forward_backward_finite():
    model = HybridForCausalLM(tiny_config()).to(torch.bfloat16).train()
    ids = torch.randint(0, 128, (1, 40))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert biases and all(b.dtype == torch.float32 for b in biases)  # the selection bias stays fp32


def test_dense_only_and_unlatent_variants_run():
    for overrides in ({"num_experts": 0}, {"routed_expert_hidden_size": 32, "latent_moe_use_norm": False}):
        model = make_model(torch.float32, **overrides)
        ids = torch.randint(0, 128, (1, 8))
        out = model(ids, labels=ids, output_router_choices=True)
        assert torch.isfinite(out.loss)
        assert (out.router_choices is None) == (overrides.get("num_experts") == 0)
