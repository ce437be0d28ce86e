"""Sample transcripts a user reads to see what the policy does: ``<run_dir>/transcripts/``.

Per training step, ``transcripts/step_NNNNNN.jsonl`` holds ``run.transcripts_per_step`` of the step's
episodes (every collection round included); per evaluation, ``transcripts/eval_NNNNNN.jsonl`` (the
evaluation after step N; 0 is the one before RL). The sample is deterministic per step and holds,
when the step has them, one episode that failed in the env, one success and one failure of the task;
the rest are drawn at random. A resumed run rewrites the files of the steps it redoes.

One JSON line per episode (``transcript``): ids, env, task, status, rewards (total, env, per reward
function), token counts, wall time, the env's info (the error and its traceback for an ERROR episode)
and per turn the text the model was fed before the turn (the rendered template, messages and tool
results: the prompt tokens decoded, special tokens kept), what it sampled, the parsed tool calls, the
env's reply, the turn reward and token counts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from envs.types import Episode, EpisodeStatus, Turn


def sample_episodes(episodes: list[Episode], k: int, seed: int = 0) -> list[Episode]:
    """``k`` episodes: an env failure, a success and a task failure first (each when there is one), then
    random others; in collection order."""
    if k <= 0 or not episodes:
        return []
    rng = random.Random(seed)
    errors = [e for e in episodes if e.status == EpisodeStatus.ERROR]
    solved = [e for e in episodes if e.status != EpisodeStatus.ERROR and e.info.get("solved")]
    unsolved = [e for e in episodes if e.status != EpisodeStatus.ERROR and not e.info.get("solved")]
    picked: list[int] = []
    for pool in (errors, solved, unsolved):
        if pool and len(picked) < k:
            picked.append(id(rng.choice(pool)))
    rest = [e for e in episodes if id(e) not in picked]
    picked += [id(e) for e in rng.sample(rest, min(k - len(picked), len(rest)))]
    return [e for e in episodes if id(e) in picked]


def _turn(t: Turn, decode) -> dict[str, Any]:
    return {
        "prompt_text": decode(t.prompt_token_ids) if decode else None,
        "text": t.text,
        "tool_calls": [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in t.tool_calls],
        "observation": t.observation,
        "reward": t.reward,
        "finish_reason": t.finish_reason,
        "prompt_tokens": len(t.prompt_token_ids),
        "sampled_tokens": len(t.token_ids),
        "policy_version": t.policy_version,
    }


def transcript(ep: Episode, decode=None) -> dict[str, Any]:
    """One episode for reading; ``decode(token_ids) -> str`` renders the prompt tokens (None: not shown)."""
    return {
        "episode_id": ep.episode_id,
        "env": ep.env_id,
        "task_id": ep.task_id,
        "status": str(ep.status),
        "status_detail": ep.status_detail,
        "reward": ep.reward,
        "env_reward": ep.env_reward,
        "reward_breakdown": dict(ep.reward_breakdown),
        "solved": bool(ep.info.get("solved", False)),
        "num_turns": len(ep.turns),
        "prompt_tokens": sum(len(t.prompt_token_ids) for t in ep.turns),
        "sampled_tokens": ep.num_sampled_tokens,
        "wall_time_s": ep.wall_time_s,
        "opening_messages": ep.messages[: len(ep.messages) - _later_messages(ep)],
        "turns": [_turn(t, decode) for t in ep.turns],
        "info": ep.info,
    }


def _later_messages(ep: Episode) -> int:
    """Messages added after the opening ones (assistant turns and env replies)."""
    return sum(1 + len(t.observation) for t in ep.turns)


class TranscriptWriter:
    """Writes the sampled transcripts of each step (see the module docstring)."""

    def __init__(self, run_dir: str | Path, per_step: int, seed: int = 0, decode=None) -> None:
        self.dir = Path(run_dir) / "transcripts"
        self.per_step, self.seed, self.decode = per_step, seed, decode

    def write(self, step: int, phase: str, episodes: list[Episode]) -> Path | None:
        """The sample of ``episodes`` (phase "train" or "eval"); None when nothing was written."""
        chosen = sample_episodes(episodes, self.per_step, seed=self.seed * 1_000_003 + step * 2 + (phase == "eval"))
        if not chosen:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / (f"step_{step:06d}.jsonl" if phase == "train" else f"eval_{step:06d}.jsonl")
        lines = [json.dumps(transcript(e, self.decode), default=str) for e in chosen]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)
        return path
