"""The reward-function protocol and the Rubric that combines reward functions.

A reward function takes the typed episode record and returns a float:

    def my_reward(episode: Episode, **params) -> float

A per-turn reward function (decorated with ``@per_turn``) returns one float per turn instead.
Functions read what they need from ``episode``: ``final_text`` / ``turns`` (texts, parsed tool
calls, per-turn env info) and ``episode.info`` (the env's reset info updated with its last step's
info: ``target``, ``answer``, ``solved``, env extras such as ``tests_passed``).

``Rubric`` sums weighted terms and keeps a per-term breakdown. Episodes whose status is TRUNCATED
or ERROR short-circuit to ``truncated_reward`` / ``error_reward`` (set either to None to score
them normally). A term that raises (or returns a non-number) raises ``RewardError`` naming it; with
``catch_errors=True`` (what the rollout manager uses) the episode instead gets ``error_reward`` (0.0
when that is None) as its total, the other terms' values stay in the breakdown, and the error texts
are in ``RubricResult.errors`` (``apply`` also writes them to ``episode.info["reward_error"]``). Per-turn terms contribute their weighted sum to the total; ``Rubric.apply`` also
adds each turn's weighted per-turn reward to ``turn.reward`` (the env's own value is kept in
``turn.info["env_reward"]``) so turn-level credit assignment sees them, and the episode total
stays ``episode.reward``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from envs.types import Episode, EpisodeGroup, EpisodeStatus


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, episode: Episode) -> float: ...


def per_turn(fn: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """Mark ``fn(episode) -> list[float]`` (one value per turn) as a per-turn reward."""
    fn.per_turn = True  # type: ignore[attr-defined]
    return fn


def is_per_turn(fn: Any) -> bool:
    return bool(getattr(fn, "per_turn", False) or getattr(getattr(fn, "func", None), "per_turn", False))


@dataclass
class RubricTerm:
    name: str
    fn: Callable[[Episode], Any]
    weight: float = 1.0

    @property
    def per_turn(self) -> bool:
        return is_per_turn(self.fn)


@dataclass
class RubricResult:
    total: float
    breakdown: dict[str, float]  # term name -> unweighted value (per-turn terms: their sum)
    turn_rewards: list[float] = field(default_factory=list)  # weighted per-turn terms, one per turn
    short_circuit: str | None = None  # "truncated" or "error" when the status decided the score,
    # "reward_error" when a term failed (catch_errors=True)
    errors: dict[str, str] = field(default_factory=dict)  # term name -> error text (catch_errors=True)


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a finite number."""


class Rubric:
    """Weighted reward terms with a breakdown; truncated/errored episodes short-circuit."""

    def __init__(
        self,
        terms: Sequence[RubricTerm | tuple[str, Callable, float]],
        truncated_reward: float | None = 0.0,
        error_reward: float | None = 0.0,
    ):
        self.terms = [t if isinstance(t, RubricTerm) else RubricTerm(*t) for t in terms]
        if not self.terms:
            raise ValueError("a Rubric needs at least one term")
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate rubric term names: {names}")
        self.truncated_reward, self.error_reward = truncated_reward, error_reward

    def score(self, episode: Episode, catch_errors: bool = False) -> RubricResult:
        n = len(episode.turns)
        if episode.status == EpisodeStatus.TRUNCATED and self.truncated_reward is not None:
            return RubricResult(
                float(self.truncated_reward),
                {"truncated": float(self.truncated_reward)},
                [0.0] * n,
                "truncated",
            )
        if episode.status == EpisodeStatus.ERROR and self.error_reward is not None:
            return RubricResult(
                float(self.error_reward), {"error": float(self.error_reward)}, [0.0] * n, "error"
            )
        breakdown: dict[str, float] = {}
        errors: dict[str, str] = {}
        turn_rewards = [0.0] * n
        total = 0.0
        for term in self.terms:
            try:
                if term.per_turn:
                    values = _turn_values(term, episode)
                    turn_rewards = [r + term.weight * v for r, v in zip(turn_rewards, values)]
                    value = float(sum(values))
                else:
                    value = _finite(term, _call(term, episode))
            except RewardError as e:
                if not catch_errors:
                    raise
                errors[term.name] = str(e)
                continue
            breakdown[term.name] = value
            total += term.weight * value
        if errors:  # a partial sum would reward an episode for a broken term: the error reward instead
            fallback = float(self.error_reward) if self.error_reward is not None else 0.0
            return RubricResult(fallback, breakdown, [0.0] * n, "reward_error", errors)
        return RubricResult(total, breakdown, turn_rewards)

    def apply(self, episode: Episode, catch_errors: bool = False) -> RubricResult:
        """Score ``episode`` and write ``reward``, ``reward_breakdown`` and per-turn rewards into it."""
        result = self.score(episode, catch_errors)
        episode.reward = result.total
        episode.reward_breakdown = dict(result.breakdown)
        if result.errors:
            episode.info["reward_error"] = "; ".join(result.errors.values())
        else:
            episode.info.pop("reward_error", None)
        for turn, extra in zip(episode.turns, result.turn_rewards):
            env_reward = turn.info.setdefault("env_reward", turn.reward)
            turn.reward = float(env_reward) + extra
        return result

    def apply_group(self, group: EpisodeGroup) -> list[RubricResult]:
        return [self.apply(e) for e in group.episodes]

    def __call__(self, episode: Episode) -> float:
        return self.score(episode).total


def _call(term: RubricTerm, episode: Episode) -> Any:
    try:
        return term.fn(episode)
    except RewardError:
        raise
    except Exception as e:
        raise RewardError(
            f"reward {term.name!r} failed on episode {episode.episode_id!r}: {type(e).__name__}: {e}"
        ) from e


def _finite(term: RubricTerm, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"reward {term.name!r} returned {value!r}, not a number") from None
    if not math.isfinite(out):
        raise RewardError(f"reward {term.name!r} returned a non-finite value {out}")
    return out


def _turn_values(term: RubricTerm, episode: Episode) -> list[float]:
    values = _call(term, episode)
    if not isinstance(values, list | tuple) or len(values) != len(episode.turns):
        raise RewardError(
            f"per-turn reward {term.name!r} must return one value per turn ({len(episode.turns)})"
        )
    return [_finite(term, v) for v in values]
