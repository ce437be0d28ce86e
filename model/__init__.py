"""The sparse hybrid model (KDA + gated MLA + MoE + Block AttnRes), K3 config field names.

Import-light on purpose: ``model.HybridConfig`` and ``model.HybridForCausalLM`` (and the other
names below) are resolved on first access, so ``import model`` does not pull in transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "HybridConfig": "model.config",
    "hybrid_layer_pattern": "model.config",
    "HybridForCausalLM": "model.modeling",
    "HybridModel": "model.modeling",
    "HybridCausalLMOutput": "model.modeling",
    "token_logprobs": "model.modeling",
    "HybridCache": "model.cache",
    "KDAState": "model.cache",
    "MLAState": "model.cache",
    "ExpertBalancer": "model.balancing",
    "LoadMetrics": "model.balancing",
    "lora_target_modules": "model.lora",
    "count_parameters": "model.params",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
