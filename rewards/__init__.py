"""Reward functions over the typed episode record, the Rubric that combines them, and a registry.

Import-light: the built-in functions are loaded by name on first use (see rewards/registry.py).
"""

from rewards.base import RewardError, RewardFn, Rubric, RubricResult, RubricTerm, per_turn
from rewards.registry import BUILTIN_REWARDS, build_rubric, load_reward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFn",
    "Rubric",
    "RubricResult",
    "RubricTerm",
    "build_rubric",
    "load_reward",
    "per_turn",
]
