"""Small hand-built episodes for the rl tests (no env, no engine)."""

from __future__ import annotations

import numpy as np

from envs.types import Episode, EpisodeGroup, EpisodeStatus, Turn


def turn(prompt: list[int], sampled: list[int], logprobs=None, reward: float = 0.0, routes=None) -> Turn:
    lps = logprobs if logprobs is not None else [-1.0] * len(sampled)
    return Turn(
        prompt_token_ids=list(prompt),
        token_ids=list(sampled),
        logprobs=list(lps),
        reward=reward,
        routed_experts=None if routes is None else np.asarray(routes, dtype=np.uint16),
    )


def episode(turns: list[Turn], reward: float, eid: str = "e", task: str = "t") -> Episode:
    return Episode(
        episode_id=eid,
        task_id=task,
        env_id="fake",
        turns=turns,
        reward=reward,
        status=EpisodeStatus.COMPLETED,
    )


def group(rewards: list[float], task: str = "t", turns_per_ep: int = 1, tokens: int = 2) -> EpisodeGroup:
    eps = []
    for i, r in enumerate(rewards):
        ts = [turn([1, 2], [10 + k] * tokens) for k in range(turns_per_ep)]
        eps.append(episode(ts, r, eid=f"{task}-{i}", task=task))
    return EpisodeGroup(task_id=task, episodes=eps)
