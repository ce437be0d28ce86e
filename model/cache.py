"""Generation cache: per layer, the KDA recurrent + conv states or the MLA latent cache.

KDA layers carry O(1) state per sequence (recurrent [N, H, K, V] fp32 and three conv states
[N, C, K-1]); MLA layers cache only the compressed c_kv [N, S, kv_lora_rank] and the shared
NoPE key part k_pe [N, S, qk_rope_head_dim], which is what the absorbed decode attends over.
Rows are sequences (N = batch size for padded input, number of sequences for packed input).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDAState:
    recurrent_NHKV: torch.Tensor  # fp32
    conv_q_NCW: torch.Tensor
    conv_k_NCW: torch.Tensor
    conv_v_NCW: torch.Tensor


@dataclass
class MLAState:
    c_kv_NSR: torch.Tensor
    k_pe_NSP: torch.Tensor

    @property
    def seq_len(self) -> int:
        return self.c_kv_NSR.shape[1]


@dataclass
class HybridCache:
    """One entry per decoder layer; None until the layer has seen a prefix."""

    layers: list[KDAState | MLAState | None] = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> HybridCache:
        return cls(layers=[None] * num_layers)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def select(self, rows: torch.Tensor) -> HybridCache:
        """Keep only the given sequence rows (e.g. drop finished sequences)."""

        def pick(state):
            if state is None:
                return None
            cls = type(state)
            return cls(**{k: v[rows] for k, v in vars(state).items()})

        return HybridCache([pick(s) for s in self.layers], self.seen_tokens)
