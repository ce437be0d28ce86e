"""Gymnasium spaces for message-space environments.

Observations are ``{"messages": [Message, ...], "tools": [tool spec, ...]}``; actions are the
assistant turn as a ``str`` or a chat message dict ``{"role": "assistant", "content": str}``.
Neither flattens to a numpy array (``is_np_flattenable`` is False), which Gymnasium allows.
"""

from __future__ import annotations

import json
from typing import Any

import gymnasium

ROLES = ("system", "user", "assistant", "tool")
_ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=().,")


class MessagesSpace(gymnasium.Space):
    """Observation space: a dict with a list of chat messages and the list of tool specs."""

    def __init__(self, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if not isinstance(x, dict) or set(x) != {"messages", "tools"}:
            return False
        if not isinstance(x["messages"], list) or not isinstance(x["tools"], list):
            return False
        return all(is_message(m) for m in x["messages"]) and all(isinstance(t, dict) for t in x["tools"])

    def sample(self, mask: Any = None, probability: Any = None) -> dict[str, Any]:
        n = int(self.np_random.integers(1, 40))
        text = "".join(self.np_random.choice(_ALPHABET, size=n))
        return {"messages": [{"role": "user", "content": text}], "tools": []}

    def __repr__(self) -> str:
        return "MessagesSpace()"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, MessagesSpace)


class AssistantTurnSpace(gymnasium.Space):
    """Action space: the assistant turn as text (with ``<tool_call>`` blocks) or a message dict."""

    def __init__(self, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if isinstance(x, str):
            return True
        return (
            isinstance(x, dict)
            and x.get("role", "assistant") == "assistant"
            and isinstance(x.get("content"), str)
        )

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """Random turns: free text, a numeric answer, or a call to a tool that does not exist."""
        kind = int(self.np_random.integers(3))
        n = int(self.np_random.integers(1, 30))
        text = "".join(self.np_random.choice(_ALPHABET, size=n))
        if kind == 0:
            return text
        if kind == 1:
            return f"<answer>{int(self.np_random.integers(-100, 1000))}</answer>"
        return "<tool_call>" + json.dumps({"name": text, "arguments": {}}) + "</tool_call>"

    def __repr__(self) -> str:
        return "AssistantTurnSpace()"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, AssistantTurnSpace)


def is_message(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
