"""Reward registry: the in-tree table, the ``longhorizon.rewards`` entry-point group, "module:fn".

``load_reward(spec, **params)`` accepts a built-in name (``"exact_match"``), the name of an entry
point in the ``longhorizon.rewards`` group of an installed distribution, a ``"module:fn"`` string
(resolved by ``envs.registry.load_object``, the project's one resolver) or a callable; ``params``
are checked against the function's signature (a misspelt one fails here, naming the close match,
not in every episode later) and bound with ``functools.partial``. ``build_rubric(config)`` builds a
Rubric from a config list; ``reward_term`` builds one of its terms.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import inspect
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


def _did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, sorted(set(options)), n=3, cutoff=0.7)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _load_module_attr(spec: str) -> Any:
    """``load_object`` with a close match named when the module has no such attribute."""
    try:
        return load_object(spec)
    except AttributeError as e:
        module_name, attr = spec.split(":")
        module = importlib.import_module(module_name)  # it imported, or load_object raised ImportError
        public = [n for n in dir(module) if not n.startswith("_")]
        raise AttributeError(f"{e}{_did_you_mean(attr.split('.')[0], public)}") from None


def check_params(fn: Callable[..., Any], params: Mapping[str, Any], spec: Any = None) -> None:
    """Raise TypeError naming each keyword that ``fn(episode, **params)`` would not accept."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: nothing to check
        return
    args = list(sig.parameters.values())
    if any(a.kind == a.VAR_KEYWORD for a in args):
        return
    names = [a.name for a in args[1:] if a.kind in (a.POSITIONAL_OR_KEYWORD, a.KEYWORD_ONLY)]
    bad = [k for k in params if k not in names]
    if bad:
        hints = ", ".join(f"{k!r}{_did_you_mean(k, names)}" for k in bad)
        raise TypeError(
            f"reward {spec or fn!r} has no parameter {hints}; its parameters after the episode: {names}"
        )


def load_reward(spec: str | Callable[..., Any], **params: Any) -> Callable[..., Any]:
    """A reward function from any of the names above, with ``params`` bound."""
    if callable(spec):
        fn = spec
    elif not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec must be a non-empty string or a callable, got {spec!r}")
    elif spec in BUILTIN_REWARDS:
        fn = load_object(BUILTIN_REWARDS[spec])
    elif ":" in spec:
        fn = _load_module_attr(spec)
    else:
        plugins = entry_point_rewards()
        if spec not in plugins:
            known = sorted({*BUILTIN_REWARDS, *plugins})
            raise ValueError(
                f"unknown reward {spec!r}{_did_you_mean(spec, known)}: not a built-in, an entry point in "
                f"{REWARD_GROUP!r} or a 'module:fn' string. Known: {known}"
            )
        fn = load_object(plugins[spec])
    if not callable(fn):
        raise TypeError(f"reward spec {spec!r} resolved to {fn!r}, which is not callable")
    if params:
        check_params(fn, params, spec)
    return functools.partial(fn, **params) if params else fn


def reward_name(spec: str | Callable[..., Any]) -> str:
    """The default term name: a built-in or entry-point name as is, the attribute of "module:attr"."""
    return spec.split(":")[-1] if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))


def reward_term(
    spec: str | Callable[..., Any], weight: float = 1.0, name: str | None = None,
    params: Mapping[str, Any] | None = None,
) -> RubricTerm:  # fmt: skip
    """One Rubric term: the resolved function (``params`` bound), its weight and name."""
    return RubricTerm(str(name or reward_name(spec)), load_reward(spec, **dict(params or {})), float(weight))


def build_rubric(
    terms: Sequence[Mapping[str, Any] | str],
    truncated_reward: float | None = 0.0,
    error_reward: float | None = 0.0,
) -> Rubric:
    """A Rubric from ``[{"reward": spec, "weight": w, "name": n, "params": {...}}, ...]`` (or bare specs).

    The experiment config's spelling is accepted too: ``fn`` for ``reward``, ``kwargs`` for ``params``.
    """
    built = []
    for term in terms:
        cfg = {"reward": term} if isinstance(term, str) else dict(term)
        cfg = {_ALIASES.get(k, k): v for k, v in cfg.items()}
        unknown = set(cfg) - {"reward", "weight", "name", "params"}
        if unknown or "reward" not in cfg:
            raise ValueError(
                f"rubric term {term!r}: needs 'reward', may have weight/name/params; got {sorted(cfg)}"
            )
        built.append(reward_term(cfg["reward"], cfg.get("weight", 1.0), cfg.get("name"), cfg.get("params")))
    return Rubric(built, truncated_reward=truncated_reward, error_reward=error_reward)


_ALIASES = {"fn": "reward", "kwargs": "params"}
