"""Shared test data for the rollout tests: a tiny random-init hybrid checkpoint in fp32 with every
feature of the CPU preset (KDA x3 + gated MLA, dense first FFN then latent SiTU MoE, Block AttnRes, tied
embeddings) and the small engine size most tests use. A module of its own (not conftest) so that test
modules can import it whichever conftest pytest loaded first."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    num_hidden_layers=4,
    linear_attn_config={"head_dim": 32, "num_heads": 2},
    num_attention_heads=2,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_experts=4,
    num_experts_per_token=2,
    moe_intermediate_size=64,
    routed_expert_hidden_size=32,  # latent MoE, as in the CPU preset
    first_k_dense_replace=1,  # one dense FFN layer first
    tie_word_embeddings=True,
    intermediate_size=128,
    attn_res_block_size=2,
    eos_token_id=2,
    pad_token_id=0,
)


# the engine size most rollout tests use: a few short episodes, a 32 MiB KV budget
SMALL_ENGINE = dict(max_model_len=768, max_num_seqs=8, kv_cache_memory_bytes=32 << 20)


def build_checkpoint(path, seed: int = 0, scale_router: float = 20.0):
    """Save a tiny model + the project tokenizer; returns the learner model (eval mode)."""
    from model.config import HybridConfig
    from model.modeling import HybridForCausalLM
    from rollout.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    model = HybridForCausalLM(HybridConfig(**TINY)).eval()
    with torch.no_grad():  # spread router scores so top-k choices are not near-ties
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.mul_(scale_router)
    model.save_pretrained(str(path))
    load_tokenizer().save_pretrained(str(path))
    return model


# a tiny transformers KimiLinearConfig (q_lora_rank, a dense first layer, a shared expert); vocab 1024 =
# the project tokenizer's
KIMI_TINY = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
    q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    linear_head_dim=32, linear_num_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)  # fmt: skip
