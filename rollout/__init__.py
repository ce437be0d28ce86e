"""Rollout: our model inside vLLM, the rollout worker with whole-turn state reuse, the chat
renderer, the multi-turn episode loop and the rollout manager.

Import-light on purpose: the names below resolve on first access, so ``import rollout`` pulls in
neither vLLM nor torch. The vLLM plugin entry point is ``rollout.vllm_plugin:register``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ChatRenderer": "rollout.renderer",
    "TemplateRenderer": "rollout.template_renderer",
    "load_renderer": "rollout.template_renderer",
    "load_tokenizer": "rollout.tokenizer",
    "RolloutWorker": "rollout.worker",
    "WorkerConfig": "rollout.worker",
    "TurnRequest": "rollout.worker",
    "TurnOutput": "rollout.worker",
    "EpisodeBudget": "rollout.episode",
    "SamplingConfig": "rollout.episode",
    "EpisodeRun": "rollout.episode",
    "run_episode": "rollout.episode",
    "drive_episodes": "rollout.episode",
    "RolloutManager": "rollout.manager",
    "TaskSpec": "rollout.manager",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
