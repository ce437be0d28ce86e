"""PEFT LoRA on attention, KDA and expert projections (the routed experts' stacked weights through
``target_parameters``): wraps, trains a step, merges exactly."""

from __future__ import annotations

import torch
from model_cases import tiny_config
from peft import LoraConfig, get_peft_model

from model.fast import use_fast_paths
from model.lora import lora_target_modules, lora_target_parameters
from model.modeling import HybridForCausalLM


def test_lora_wraps_trains_and_merges_to_identical_outputs():
    model = HybridForCausalLM(tiny_config(q_lora_rank=16, routed_expert_hidden_size=32))
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=lora_target_modules(),
        target_parameters=lora_target_parameters(),
    )
    peft_model = get_peft_model(model, lora)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in peft_model.named_parameters() if ".lora_A" in n}
    for needle in (
        "self_attn.q_a_proj",  # MLA
        "self_attn.kv_b_proj",
        "self_attn.f_a_proj",  # KDA
        "self_attn.k_proj",
        "block_sparse_moe.experts.base_layer",  # routed experts: gate_up_proj (peft nests the wrappers)
        "block_sparse_moe.experts",  # and down_proj
        "shared_experts.down_proj",
        "routed_expert_up_proj",
    ):
        assert any(needle in n for n in wrapped), needle
    assert not any(n.endswith(".gate") for n in wrapped)  # the router is not a LoRA target
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    ids = torch.randint(0, 128, (2, 12))
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    expert_grads = [p.grad for n, p in peft_model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(expert_grads) == 2 * 3 and all(float(g.abs().sum()) > 0 for g in expert_grads)
    opt.step()
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        base = peft_model.get_base_model()
        with peft_model.disable_adapter():
            plain = base(ids).logits
        assert not torch.allclose(adapted, plain)  # the step changed the function
        cached = base.generate(ids[:, :6], max_new_tokens=3)  # absorbed MLA sees the adapter too
    merged = peft_model.merge_and_unload()
    assert isinstance(merged, HybridForCausalLM)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-5, atol=1e-5)
        assert torch.equal(merged.generate(ids[:, :6], max_new_tokens=3), cached)


def test_peft_causal_lm_task_type_forward_and_generate():
    model = HybridForCausalLM(tiny_config())
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=lora_target_modules())
    peft_model = get_peft_model(model, lora).eval()
    ids = torch.randint(0, 128, (1, 8))
    assert torch.isfinite(peft_model(input_ids=ids, labels=ids).loss)
    assert peft_model.generate(input_ids=ids, max_new_tokens=3).shape == (1, 11)


def test_lora_on_routed_experts_grouped_equals_loop():
    """The adapter merges into the stacked weights at each forward, so both MoE paths see it."""
    torch.manual_seed(0)
    model = HybridForCausalLM(tiny_config(routed_expert_hidden_size=32))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=lora_target_parameters())
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)  # a nonzero adapter (peft starts B at zero)
    ids = torch.randint(0, 128, (1, 20))
    outs = {}
    for impl in ("loop", "grouped"):
        with use_fast_paths("auto", moe=impl), torch.no_grad():
            outs[impl] = peft_model(input_ids=ids).logits
    torch.testing.assert_close(outs["grouped"], outs["loop"], rtol=1e-5, atol=1e-5)
    with peft_model.disable_adapter(), torch.no_grad():
        assert not torch.allclose(peft_model(input_ids=ids).logits, outs["loop"], atol=1e-4)
