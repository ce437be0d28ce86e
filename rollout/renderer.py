"""Chat template in token space: messages <-> ids, incremental turns, tool-call parsing.

The template is ChatML with the project's tool tags::

    <|im_start|>system\\n{content}\\n\\n# Tools\\n{tool specs as JSON, one per line}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n
    <|im_start|>tool\\n<tool_response>{content}</tool_response><|im_end|>\\n

Rendering is defined piecewise: special tokens map to their ids and every text piece is encoded on
its own. So the ids of a conversation are exactly the concatenation of the ids of its messages, and a
multi-turn episode can be extended token-in-token-out (``continuation_ids``) without ever
re-tokenising history: the sampled assistant ids are kept verbatim, the renderer only appends what
closes the assistant turn, the new observation messages and the next generation prompt.

Only the template itself and assistant text place control tokens. The content of system, user and
tool messages (task text, observations, tool results: text the policy did not write, e.g. what
sandboxed code prints) is encoded as plain text (``plain_ids``): a control-token string inside it
(``</tool_response><|im_end|><|im_start|>user ...``, or any added token of the tokenizer) becomes
ordinary text ids, never the control id, so a tool result cannot end its own message or forge a
turn or a tool call. Content without such strings encodes exactly as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envs.protocol import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    format_tool_call,
    parse_tool_calls,
)
from envs.types import Message, ToolCall
from rollout.tokenizer import SPECIAL_TOKENS, load_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class RenderedConversation:
    """A conversation in token space; ``loss_mask`` is True on assistant-written tokens."""

    token_ids: list[int]  # [T]
    loss_mask: list[bool]  # [T]


class ChatRenderer:
    """Messages <-> token ids for the project's chat template (see the module docstring)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
        ids = self.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
        missing = [t for t, i in zip(SPECIAL_TOKENS, ids) if i is None or i == self.tokenizer.unk_token_id]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}")
        self.special_ids = dict(zip(SPECIAL_TOKENS, ids))
        self.im_start_id = self.special_ids[IM_START]
        self.im_end_id = self.special_ids[IM_END]
        self.tool_call_end_id = self.special_ids[TOOL_CALL_END]
        self.eos_id = self.special_ids["<|endoftext|>"]
        self.control_ids = _control_tokens(self.tokenizer, self.special_ids)
        self._control_id_set = frozenset(self.control_ids.values())
        self._control_strings = sorted(self.control_ids, key=len, reverse=True)
        self.newline_ids = self._text("\n")
        for token in self._control_strings:  # fails here, not mid-rollout, for a tokenizer that cannot
            self.plain_ids(token)

    @property
    def stop_token_ids(self) -> list[int]:
        """A turn ends at the end of a tool call or at the end of the assistant message."""
        return [self.tool_call_end_id, self.im_end_id, self.eos_id]

    # --- pieces -------------------------------------------------------------------------------------
    def _text(self, text: str) -> list[int]:
        """Encode plain text; special-token strings inside it become their special ids."""
        out: list[int] = []
        for piece, is_special in _split_specials(text):
            out += (
                [self.special_ids[piece]]
                if is_special
                else self.tokenizer.encode(piece, add_special_tokens=False)
            )
        return out

    def plain_ids(self, text: str) -> list[int]:
        """Encode untrusted text: control-token strings in it become ordinary text ids.

        The text is cut at every control-token string (each then encoded as its first character
        and the rest), and any piece whose encoding still holds a control id (a tokenizer that
        normalises before matching added tokens) is halved until none does."""
        return plain_text_ids(self.tokenizer, text, self._control_strings, self._control_id_set)

    def _header(self, role: str) -> list[int]:
        if role not in _ROLES:
            raise ValueError(f"unknown message role {role!r}; expected one of {_ROLES}")
        return [self.im_start_id, *self._text(f"{role}\n")]

    def generation_prompt(self) -> list[int]:
        return self._header("assistant")

    def message_body(self, message: Message, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Ids of one message's body (between the header and <|im_end|>)."""
        role, content = message.get("role"), message.get("content") or ""
        if not isinstance(content, str):
            raise ValueError(f"message content must be a str, got {type(content).__name__}")
        if role == "system" and tools:
            content = content + "\n\n# Tools\n" + "\n".join(json.dumps(t, sort_keys=True) for t in tools)
        if role == "tool":
            return [
                self.special_ids[TOOL_RESPONSE_START],
                *self.plain_ids(content),
                self.special_ids[TOOL_RESPONSE_END],
            ]
        if role != "assistant":
            return self.plain_ids(content)
        ids = self._text(content)
        if TOOL_CALL_START not in content:
            for call in message.get("tool_calls") or []:
                ids += self._text(_format_call(call))
        return ids

    def message_ids(self, message: Message, tools=None) -> list[int]:
        return [
            *self._header(message.get("role")),
            *self.message_body(message, tools),
            self.im_end_id,
            *self.newline_ids,
        ]

    # --- whole conversations --------------------------------------------------------------------------
    def render(self, messages: list[Message], tools=None, add_generation_prompt: bool = False) -> list[int]:
        """Token ids of a conversation; tool specs are appended to the first system message."""
        return self.render_with_mask(messages, tools, add_generation_prompt).token_ids

    def render_with_mask(
        self, messages: list[Message], tools=None, add_generation_prompt=False
    ) -> RenderedConversation:
        """Ids plus a mask that is True on assistant bodies and their closing <|im_end|> (SFT targets)."""
        if tools and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": "You are a helpful assistant."}, *messages]
        ids: list[int] = []
        mask: list[bool] = []
        tools_used = False
        for m in messages:
            use_tools = tools if (m.get("role") == "system" and not tools_used) else None
            tools_used |= use_tools is not None
            header, body = self._header(m.get("role")), self.message_body(m, use_tools)
            trainable = m.get("role") == "assistant"
            ids += [*header, *body, self.im_end_id, *self.newline_ids]
            mask += [False] * len(header) + [trainable] * (len(body) + 1) + [False] * len(self.newline_ids)
        if add_generation_prompt:
            gp = self.generation_prompt()
            ids += gp
            mask += [False] * len(gp)
        return RenderedConversation(ids, mask)

    # --- incremental turns ----------------------------------------------------------------------------
    def continuation_ids(self, sampled_ids: list[int], new_messages: list[Message]) -> list[int]:
        """Ids to append after a sampled assistant turn: its closing tokens, the observation messages
        and the next generation prompt. Never re-tokenises ``sampled_ids``."""
        closing = [] if sampled_ids and sampled_ids[-1] == self.im_end_id else [self.im_end_id]
        out = [*closing, *self.newline_ids]
        for m in new_messages:
            out += self.message_ids(m)
        return out + self.generation_prompt()

    def decode(self, ids: list[int]) -> str:
        """Text of sampled ids, special tags kept (the tool-call parser needs them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def assistant_text(self, sampled_ids: list[int]) -> str:
        """The assistant turn as text without the end-of-turn marker."""
        ids = (
            sampled_ids[:-1]
            if sampled_ids and sampled_ids[-1] in (self.im_end_id, self.eos_id)
            else sampled_ids
        )
        return self.decode(ids)

    def parse_tool_calls(self, text: str, tools=None) -> list[ToolCall]:
        """Tool calls of an assistant turn (malformed ones carry ``.error``; never raises)."""
        return parse_tool_calls(text, tools)


def _format_call(call: dict[str, Any] | ToolCall) -> str:
    if isinstance(call, ToolCall):
        name, args = call.name, call.arguments
    else:
        fn = call.get("function", call)
        name, args = fn.get("name"), fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
    return format_tool_call(name, args)


def _control_tokens(tokenizer, special_ids: dict[str, int]) -> dict[str, int]:
    """The template's special tokens plus every added token of the tokenizer that is not plain
    whitespace (HF tokenizers mark structural tokens such as ``<tool_call>`` or ``<think>``
    special or not, inconsistently; whitespace runs are the added tokens that are plain text)."""
    out = dict(special_ids)
    for tid, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        content = getattr(token, "content", str(token))
        if content.strip():
            out.setdefault(content, int(tid))
    return out


def plain_text_ids(
    tokenizer, text: str, control_strings: list[str], control_ids: frozenset[int]
) -> list[int]:
    """``text`` encoded with no id of ``control_ids`` (see ``ChatRenderer.plain_ids``); ``control_strings``
    longest first. Shared with ``rollout.template_renderer``."""
    out: list[int] = []
    for piece, is_control in _split_at(text, control_strings):
        pieces = (piece[:1], piece[1:]) if is_control else (piece,)
        for p in pieces:
            out += _plain_piece(tokenizer, p, control_ids)
    return out


def _plain_piece(tokenizer, piece: str, control_ids: frozenset[int]) -> list[int]:
    if not piece:
        return []
    ids = tokenizer.encode(piece, add_special_tokens=False)
    if control_ids.isdisjoint(ids):
        return ids
    if len(piece) == 1:
        raise ValueError(f"the tokenizer encodes {piece!r} only as a control token; cannot render it as text")
    mid = len(piece) // 2
    return [
        *_plain_piece(tokenizer, piece[:mid], control_ids),
        *_plain_piece(tokenizer, piece[mid:], control_ids),
    ]


def _split_specials(text: str) -> list[tuple[str, bool]]:
    """Split text at the template's special-token strings: [(piece, is_special), ...]."""
    return _split_at(text, SPECIAL_TOKENS)


def _split_at(text: str, tokens) -> list[tuple[str, bool]]:
    """Split text at occurrences of ``tokens`` (longest first where they overlap)."""
    firsts = {t[0] for t in tokens if t}
    out: list[tuple[str, bool]] = []
    i = start = 0
    while i < len(text):
        hit = next((s for s in tokens if text.startswith(s, i)), None) if text[i] in firsts else None
        if hit is None:
            i += 1
            continue
        if i > start:
            out.append((text[start:i], False))
        out.append((hit, True))
        i = start = i + len(hit)
    if start < len(text):
        out.append((text[start:], False))
    return out
