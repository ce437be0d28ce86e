"""Reward registry: the in-tree table, the ``longhorizon.rewards`` entry-point group, "module:fn".

``load_reward(spec, **params)`` accepts a built-in name (``"exact_match"``), the name of an entry
point in the ``longhorizon.rewards`` group of an installed distribution, a ``"module:fn"`` string
(resolved by ``envs.registry.load_object``, the project's one resolver) or a callable; ``params``
are bound with ``functools.partial``. ``build_rubric(config)`` builds a Rubric from a config list.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envs.registry import load_object
from rewards.base import Rubric, RubricTerm

REWARD_GROUP = "longhorizon.rewards"

BUILTIN_REWARDS: dict[str, str] = {
    "exact_match": "rewards.builtin:exact_match",
    "answer_equivalence": "rewards.builtin:answer_equivalence",
    "solved": "rewards.builtin:solved",
    "env_reward": "rewards.builtin:env_reward",
    "format_compliance": "rewards.builtin:format_compliance",
    "tool_call_validity": "rewards.builtin:tool_call_validity",
    "code_test_pass_rate": "rewards.builtin:code_test_pass_rate",
    "turn_penalty": "rewards.builtin:turn_penalty",
    "length_penalty": "rewards.builtin:length_penalty",
    "env_turn_rewards": "rewards.builtin:env_turn_rewards",
    "tool_error_turn_penalty": "rewards.builtin:tool_error_turn_penalty",
}
"""Built-in reward functions: name -> "module:fn"."""


def entry_point_rewards() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=REWARD_GROUP)}


def load_reward(spec: str | Callable[..., Any], **params: Any) -> Callable[..., Any]:
    """A reward function from any of the names above, with ``params`` bound."""
    if callable(spec):
        fn = spec
    elif not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec must be a non-empty string or a callable, got {spec!r}")
    elif spec in BUILTIN_REWARDS:
        fn = load_object(BUILTIN_REWARDS[spec])
    elif ":" in spec:
        fn = load_object(spec)
    else:
        plugins = entry_point_rewards()
        if spec not in plugins:
            known = sorted([*BUILTIN_REWARDS, *plugins])
            raise ValueError(
                f"unknown reward {spec!r}: not a built-in, an entry point in {REWARD_GROUP!r} "
                f"or a 'module:fn' string. Known: {known}"
            )
        fn = load_object(plugins[spec])
    if not callable(fn):
        raise TypeError(f"reward spec {spec!r} resolved to {fn!r}, which is not callable")
    return functools.partial(fn, **params) if params else fn


def build_rubric(
    terms: Sequence[Mapping[str, Any] | str],
    truncated_reward: float | None = 0.0,
    error_reward: float | None = 0.0,
) -> Rubric:
    """A Rubric from ``[{"reward": spec, "weight": w, "name": n, "params": {...}}, ...]`` (or bare specs)."""
    built = []
    for term in terms:
        cfg = {"reward": term} if isinstance(term, str) else dict(term)
        unknown = set(cfg) - {"reward", "weight", "name", "params"}
        if unknown or "reward" not in cfg:
            raise ValueError(
                f"rubric term {term!r}: needs 'reward', may have weight/name/params; got {sorted(cfg)}"
            )
        spec = cfg["reward"]
        default = spec.split(":")[-1] if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
        name = cfg.get("name") or default
        fn = load_reward(spec, **dict(cfg.get("params") or {}))
        built.append(RubricTerm(str(name), fn, float(cfg.get("weight", 1.0))))
    return Rubric(built, truncated_reward=truncated_reward, error_reward=error_reward)
