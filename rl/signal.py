"""No-learning-signal detection: the driver says when training cannot learn, and what to change.

A group-baseline objective (GRPO family, RLOO) learns nothing from a group whose episodes all got the
same reward: every advantage in it is zero. When every group of a step is like that, the step has
no learning signal; ``patience`` such steps in a row mean the run is spending its time on nothing (the
policy never or always succeeds, or the reward functions give every episode of a task the same
value). A batch-baseline objective (REINFORCE++, PPO) still learns across groups, so for it a step
has no signal only when every reward of the step is equal. A held-out success of 0 (or 100%) before
RL says the same from the other end.

``signal_metrics(groups)`` is what the collection logs per step (``signal/*``);
``NoSignalDetector`` turns those metrics into warnings (each once per streak) and keeps them for
the summary. It is pure (no I/O) and its state round-trips through ``state_dict`` for resumes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from envs.types import EpisodeGroup

EPS = 1e-9


def signal_metrics(groups: list[EpisodeGroup], eps: float = EPS) -> dict[str, float]:
    """``signal/groups`` scored, ``signal/zero_variance_groups`` (all rewards of the group equal) and
    ``signal/reward_range`` (max - min reward over every episode of the step)."""
    rewards = [g.rewards for g in groups if g.episodes]
    flat = [r for rs in rewards for r in rs]
    return {
        "signal/groups": float(len(rewards)),
        "signal/zero_variance_groups": float(sum(max(rs) - min(rs) <= eps for rs in rewards)),
        "signal/reward_range": (max(flat) - min(flat)) if flat else 0.0,
    }


@dataclass
class NoSignalDetector:
    patience: int = 3
    """Consecutive steps without signal before the warning; 0 = never warn about steps."""
    grouped: bool = True
    """The objective uses group baselines/scales (zero-variance groups carry no signal)."""
    streak: int = 0
    streak_start: int = 0
    warnings: list[str] = field(default_factory=list)

    def observe(self, step: int, metrics: dict[str, Any]) -> list[str]:
        """One step's metrics (``signal_metrics`` + ``reward/*``) in; the new warnings out."""
        if "signal/groups" not in metrics:  # e.g. metrics collected by an older version
            return []
        if not self._no_signal(metrics):
            self.streak = 0
            return []
        self.streak += 1
        self.streak_start = step if self.streak == 1 else self.streak_start
        if self.patience < 1 or self.streak != self.patience:
            return []
        return self._add(self._step_message(step, metrics))

    def observe_groups(self, step: int, groups: list[EpisodeGroup], metrics: dict[str, Any] | None = None):
        return self.observe(step, {**(metrics or {}), **signal_metrics(groups)})

    def observe_eval_before(self, metrics: dict[str, Any]) -> list[str]:
        """The held-out evaluation before RL: a success of 0 (or 1) leaves RL no headroom to show."""
        s, truncated = metrics.get("eval/success_rate"), metrics.get("eval/truncated") or 0.0
        if s == 0 and truncated >= 0.5:
            return self._add(
                f"held-out success is 0% before RL and {100 * truncated:.0f}% of the held-out episodes were "
                "cut by a budget before they ended: raise rollout.max_tokens_per_turn, "
                "rollout.max_context_tokens, rollout.max_turns or rollout.episode_timeout_s "
                "(the episodes' status_detail in transcripts/eval_*.jsonl names the budget)."
            )
        if s == 0:
            return self._add(
                "held-out success is 0% before RL: the starting policy solves no held-out task, so "
                "training sees a positive reward only when sampling stumbles on one. Warm start longer "
                "or on easier tasks (sft.*), lower the env difficulty (env.kwargs.<Env>.difficulty), "
                "or check that the warm start ran (model.init_from, sft.enabled)."
            )
        if s == 1:
            return self._add(
                "held-out success is 100% before RL: nothing is left to improve on this evaluation. "
                "Use harder tasks (env.kwargs.<Env>.difficulty) or a shorter warm start."
            )
        return []

    # --- internals ------------------------------------------------------------------------------------
    def _no_signal(self, m: dict[str, Any]) -> bool:
        groups = m["signal/groups"]
        if groups <= 0:
            return False
        if self.grouped:
            return m["signal/zero_variance_groups"] >= groups
        return m["signal/reward_range"] <= EPS

    def _step_message(self, step: int, m: dict[str, Any]) -> str:
        what = "every group had identical rewards" if self.grouped else "every episode had the same reward"
        success = m.get("reward/success_rate")
        facts = f"reward/mean {m.get('reward/mean', float('nan')):.3g}"
        facts += f", success {100 * success:.0f}%" if success is not None else ""
        if success == 0:
            cause = (
                "the policy never succeeds. Warm start longer or on easier tasks (sft.*), lower the env "
                "difficulty (env.kwargs.<Env>.difficulty), or sample more (rollout.group_size, temperature)"
            )
        elif success == 1:
            cause = "the policy always succeeds. Warm start shorter or raise the difficulty"
        else:
            cause = (
                "the rewards do not depend on what the episodes do. Check the reward functions "
                "(reward.functions: a constant or failing function, error_reward) and the env's reward"
            )
        if success in (0, 1) and any(k.startswith("reward/fn/") for k in m):
            cause += (
                "; or the reward functions (reward.functions) give every episode of a task the same value"
            )
        return (
            f"no learning signal: {what} for {self.streak} consecutive steps (steps {self.streak_start}-"
            f"{step}; {facts}), so every advantage is zero. Likely cause: {cause}."
        )

    def _add(self, message: str) -> list[str]:
        self.warnings.append(message)
        return [message]

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any] | None, **defaults: Any) -> NoSignalDetector:
        """A detector resumed from ``state_dict()`` (the current config's patience/grouped win)."""
        kept = {k: v for k, v in (state or {}).items() if k in ("streak", "streak_start", "warnings")}
        return cls(**defaults, **kept)
