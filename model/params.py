"""Parameter counts of a config without allocating it (meta device).

``active`` is what one token touches: everything except the routed experts it is not sent to,
i.e. total - (num_experts - num_experts_per_token) * one expert * MoE layers. Embedding and LM
head are counted in both (the usual convention of MoE model cards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import HybridConfig


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    embedding: int  # input embedding (+ LM head when untied)


def count_parameters(config: HybridConfig) -> ParamCount:
    from transformers.initialization import no_init_weights

    from model.modeling import HybridForCausalLM

    with torch.device("meta"), no_init_weights():  # shapes only: skip the (slow) init pass
        model = HybridForCausalLM(config)
    model.tie_weights()  # no_init_weights also skips tying: count a tied LM head once
    total = sum(p.numel() for p in model.parameters())
    per_expert = 0
    moe_layers = [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]
    if moe_layers:
        per_expert = sum(p.numel() for p in moe_layers[0].experts.parameters()) // config.num_experts
    inactive = (config.num_experts - config.num_experts_per_token) * per_expert * len(moe_layers)
    embedding = model.model.embed_tokens.weight.numel()
    if not config.tie_word_embeddings:
        embedding += model.lm_head.weight.numel()
    return ParamCount(total=total, active=total - inactive, embedding=embedding)
