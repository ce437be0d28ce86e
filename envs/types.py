"""Typed records shared by every stage: tool calls, turns, episodes, episode groups.

Messages stay plain chat-API dicts (``{"role": ..., "content": ..., "tool_calls": [...]}``),
the format users already write; everything that crosses a package boundary around them is
a dataclass here. The token view of an episode is a concatenation of its turns:

    [turn0.prompt_token_ids | turn0.token_ids | turn1.prompt_token_ids | turn1.token_ids | ...]

where ``prompt_token_ids`` are tokens the policy did not sample (the chat template, the
opening messages, tool responses) and ``token_ids`` are the sampled assistant tokens.
Only sampled tokens carry loss.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Message = dict[str, Any]
"""A chat message: ``role`` in {system, user, assistant, tool}, ``content`` str, optional
``tool_calls`` (assistant) and ``name`` / ``tool_call_id`` (tool)."""


class EpisodeStatus(enum.StrEnum):
    """How an episode ended. Gymnasium's terminated/truncated split, plus errors."""

    RUNNING = "running"
    COMPLETED = "completed"
    """The environment terminated the episode (the task's own end, solved or not)."""
    TRUNCATED = "truncated"
    """A budget ran out first: turns, tokens, context length or wall time."""
    ERROR = "error"
    """The environment, a tool or the rollout worker failed; the episode is kept for inspection."""


@dataclass
class ToolCall:
    """One parsed tool call of an assistant turn."""

    name: str
    arguments: dict[str, Any]
    id: str = ""
    error: str | None = None
    """Why the call could not be parsed or validated (None when it is well formed)."""

    def to_message_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Turn:
    """One assistant turn: the tokens fed before it, what was sampled, and the env's answer."""

    prompt_token_ids: list[int]  # [P] template/observation tokens appended before sampling (no loss)
    token_ids: list[int]  # [A] sampled assistant tokens
    logprobs: list[float]  # [A] sampling logprobs of token_ids, from the rollout engine
    text: str = ""  # the assistant turn decoded (for parsing and for reading, never re-tokenised)
    tool_calls: list[ToolCall] = field(default_factory=list)
    observation: list[Message] = field(default_factory=list)  # messages the env returned for this turn
    reward: float = 0.0  # the env's per-turn reward
    # routing replay (R3): the experts the engine routed each token to when it fed that token, [n, L, K]
    # (num_moe_layers, top_k) int16 / uint16, "none" (-1 / 65535) where it fed no such token. Sampled
    # tokens: the last one's row is filled in by the next turn, which feeds it first.
    routed_experts: np.ndarray | None = None  # [A, L, K] of token_ids
    prompt_routed_experts: np.ndarray | None = None  # [P, L, K] of prompt_token_ids (none: prefix-cache hit)
    policy_version: int = 0  # weights version that sampled this turn
    finish_reason: str = ""  # engine's reason: "stop", "length", "tool_call", ...
    num_computed_prompt_tokens: int | None = None  # prefill tokens the engine actually computed
    info: dict[str, Any] = field(default_factory=dict)  # the env's step info


@dataclass
class Episode:
    """One multi-turn episode of one task."""

    episode_id: str
    task_id: str
    env_id: str
    messages: list[Message] = field(default_factory=list)  # the whole conversation, opening messages first
    tools: list[dict[str, Any]] = field(default_factory=list)  # tool specs offered at reset
    turns: list[Turn] = field(default_factory=list)
    status: EpisodeStatus = EpisodeStatus.RUNNING
    status_detail: str = ""  # e.g. "max_turns", "max_tokens", "timeout", or an error message
    reward: float = 0.0  # the rubric's total, set after scoring
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # task facts for rewards (target, answer, solved, ...)
    wall_time_s: float = 0.0

    @property
    def env_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def token_ids(self) -> list[int]:  # [T]
        return [tok for t in self.turns for tok in (*t.prompt_token_ids, *t.token_ids)]

    @property
    def loss_mask(self) -> list[bool]:  # [T], True on sampled tokens only
        return [
            m
            for t in self.turns
            for m in (*([False] * len(t.prompt_token_ids)), *([True] * len(t.token_ids)))
        ]

    @property
    def rollout_logprobs(self) -> list[float]:  # [T], 0 on non-sampled tokens
        return [lp for t in self.turns for lp in (*([0.0] * len(t.prompt_token_ids)), *t.logprobs)]

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def final_text(self) -> str:
        """The last assistant turn's text (where most tasks put the answer)."""
        return self.turns[-1].text if self.turns else ""


@dataclass
class EpisodeGroup:
    """G episodes of the same task: the unit of group baselines (GRPO family)."""

    task_id: str
    episodes: list[Episode]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]
