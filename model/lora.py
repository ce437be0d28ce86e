"""Which projections LoRA adapters go on (PEFT ``target_modules`` and ``target_parameters``).

Attention (MLA), KDA, shared-expert, dense-MLP and latent projections are plain ``nn.Linear`` modules, so
PEFT's LoRA wraps them directly (``target_modules``). The routed experts are two stacked weights per layer
(``model.moe.GroupedExperts``): PEFT adapts them as parameters (``target_parameters``: one rank-r adapter
per expert, merged into the weight at each forward; no LoRA dropout there). The router (``MoEGate``), the short convolutions, the norms and the decay
parameters (A_log, dt_bias) stay frozen-base (they are not Linear layers). PEFT matches a target
name against the end of each module path, so "up_proj" does not catch "routed_expert_up_proj".
"""

from __future__ import annotations

ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj")
# g_a_proj / g_b_proj: the low-rank output gate of converted Kimi Linear checkpoints
KDA = (
    "q_proj",
    "k_proj",
    "v_proj",
    "f_a_proj",
    "f_b_proj",
    "b_proj",
    "g_proj",
    "g_a_proj",
    "g_b_proj",
    "o_proj",
)
EXPERTS = ("gate_proj", "up_proj", "down_proj")  # the shared experts' (and dense layers') nn.Linear
LATENT = ("routed_expert_down_proj", "routed_expert_up_proj")
ROUTED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # parameters, not modules


def lora_target_modules(attention: bool = True, kda: bool = True, experts: bool = True) -> list[str]:
    """Module-name suffixes for ``peft.LoraConfig(target_modules=...)``."""
    names: list[str] = []
    for on, group in ((attention, ATTENTION), (kda, KDA), (experts, EXPERTS + LATENT)):
        if on:
            names += [n for n in group if n not in names]
    return names


def lora_target_parameters(experts: bool = True) -> list[str]:
    """Parameter names for ``peft.LoraConfig(target_parameters=...)``: the routed experts' stacked weights."""
    return list(ROUTED_EXPERTS) if experts else []
