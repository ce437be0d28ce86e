"""Small configs for the model tests (fast on 2 CPU cores)."""

from __future__ import annotations

from pathlib import Path

from model.config import HybridConfig

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "model"


def tiny_config(**overrides) -> HybridConfig:
    """4 layers (3 KDA + 1 MLA), AttnRes blocks of 2, 8 experts top-2, one dense layer."""
    base = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        linear_attn_config={"head_dim": 16, "num_heads": 2},
        num_attention_heads=2,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        first_k_dense_replace=1,
        attn_res_block_size=2,
    )
    return HybridConfig(**{**base, **overrides})
