"""Play an episode at the text level (no tokens) and record it as ``envs.types.Episode``.

For scripted-expert trajectories (warm-start data, tests) and for checking envs and rewards
without a model. The token-level loop with a real policy is rollout/episode.py; both fill the
record the same way: ``messages`` = the whole conversation, one ``Turn`` per assistant turn with
its text, parsed calls, observation, env reward and step info, and ``info`` = the reset info
updated with the last step's info.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from envs import protocol
from envs.base import ToolEnv, action_text
from envs.types import Episode, EpisodeStatus, Message, Turn

Policy = Callable[[ToolEnv, list[Message]], "str | Message"]


def expert_policy(env: ToolEnv, messages: list[Message]) -> str:
    return env.expert_action()


def play_episode(
    env: ToolEnv,
    policy: Policy = expert_policy,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    env_id: str = "",
) -> Episode:
    """Reset ``env`` and step it with ``policy(env, messages_so_far)`` until the episode ends."""
    start = time.monotonic()
    obs, info = env.reset(seed=seed, options=options)
    episode = Episode(
        episode_id=uuid.uuid4().hex[:12],
        task_id=info["task_id"],
        env_id=env_id or getattr(env, "env_name", type(env).__name__),
        messages=list(obs["messages"]),
        tools=list(obs["tools"]),
        info=dict(info),
    )
    while episode.status == EpisodeStatus.RUNNING:
        action = policy(env, episode.messages)
        text, _ = action_text(action)
        obs, reward, terminated, truncated, step_info = env.step(action)
        calls = protocol.parse_tool_calls(text, episode.tools, env.max_call_bytes, env.max_calls_per_turn)
        episode.turns.append(
            Turn(
                [],
                [],
                [],
                text=text,
                tool_calls=calls,
                observation=obs["messages"],
                reward=reward,
                info=step_info,
            )
        )
        episode.messages += [{"role": "assistant", "content": text}, *obs["messages"]]
        episode.info.update(step_info)
        if terminated:
            episode.status = EpisodeStatus.COMPLETED
        elif truncated:
            episode.status, episode.status_detail = EpisodeStatus.TRUNCATED, "max_turns"
    episode.wall_time_s = time.monotonic() - start
    return episode
