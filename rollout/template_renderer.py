"""Rendering through a tokenizer's own chat template (a checkpoint's ``tokenizer_config.json`` /
``chat_template.jinja``), token-in-token-out.

``ChatRenderer`` (rollout/renderer.py) writes the project's ChatML layout piece by piece.
``TemplateRenderer`` renders whatever layout a Hugging Face chat template defines, through
``apply_chat_template`` with tools, behind the same interface (``render``, ``message_body``,
``continuation_ids``, ``stop_token_ids``, ``tool_call_end_id``, ``im_end_id``, ``assistant_text``,
``parse_tool_calls``, ``decode``), so the episode loop, the manager and the warm start use either.
``load_renderer(tokenizer_dir)`` gives the one for a run (``model.tokenizer`` in rl/config.py).

Messages stay in the env's format (envs/protocol.py: assistant content carries
``<tool_call>{json}</tool_call>`` blocks); tokens are in the template's. The renderer translates: a
rendered assistant message's blocks become the template's ``tool_calls`` entries, which the template
writes in its own syntax; a sampled turn read back (``assistant_text``) has the template's tool-call
syntax rewritten as ``<tool_call>`` blocks (``ToolCallFormat.to_protocol``), a malformed call such that
the env's parser names the problem. Formats known: ``<tool_call>{json}</tool_call>`` (ours, Hermes,
Qwen) and Kimi's ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>``.

Incremental turns. ``continuation_ids`` does not see the episode's history: it renders a fixed context,
a stand-in for the sampled turn (its tool calls' names, no text) and the new messages, and keeps the
text after the stand-in's stop token; ``message_body`` is the text between a generation prompt and the
end-of-turn token. Both are exact only if the template renders each message independently of the
others, so ``check_incremental`` verifies at start, on a probe conversation (reasoning in ``<think>``,
tool calls, tool results, a user message, a final answer), that per turn the ids appended turn by turn
equal the tokenization of the whole conversation rendered at once. A template that fails (one that
strips earlier reasoning, renders the last turn differently from past ones, merges text across turns)
raises ``TemplateError`` naming the turn and the first differing tokens; with ``template_check="warn"``
it warns instead and goes on: RL is still consistent (the learner trains on the ids the engine saw), but
those are not what the template renders for the same conversation at deployment.

A template whose generation prompt differs from how it writes an assistant turn's start (one that
adds an empty ``<think></think>`` to the prompt only, say) cannot be rendered turn by turn at all: it is a
``TemplateError`` at start whatever ``template_check`` says.

Untrusted content: system, user and tool content whose encoding would hold a control id (any added
token's string, e.g. a tool printing ``<|im_end|>``) goes through the template as a placeholder and is
encoded on its own as plain text (``plain_text_ids``), so it cannot forge a turn or a tool call.
Deviation: a template that transforms content (trims it, say) does not see such content.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs import protocol
from envs.types import Message, ToolCall
from rollout.renderer import _control_tokens, _split_at, plain_text_ids
from rollout.template_check import TEMPLATE_CHECKS

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
)
"""A directory holds a tokenizer when it has one of these."""


class TemplateError(ValueError):
    """A tokenizer or its chat template cannot serve as the rollout renderer (the message says why)."""


# ---------------------------------------------------------------------------- tool-call formats


@dataclass(frozen=True)
class ToolCallFormat:
    """How a template writes tool calls in token space."""

    name: str
    marker: str
    """Text that shows a rendered tool call is in this format."""
    end: str
    """The token that ends a turn's tool calls (the engine stops on it)."""
    to_protocol: Callable[[str], str]
    """Sampled text -> the same text with every tool call as a ``<tool_call>`` block."""
    call_id: Callable[[str, int], str]
    """The id the template shows for the i-th call of a turn (and for the tool message answering it)."""


_KIMI_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)(?:<\|tool_calls_section_end\|>|\Z)", re.S)
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)(<\|tool_call_end\|>|\Z)", re.S
)


def kimi_to_protocol(text: str) -> str:
    """Kimi's tool-call sections rewritten as ``<tool_call>`` blocks; the rest of the text kept."""
    return _KIMI_SECTION.sub(lambda m: _kimi_section(m.group(1)), text)


def _kimi_section(body: str) -> str:
    calls = list(_KIMI_CALL.finditer(body))
    if not calls:  # a section without a readable call: the env's parser reports it (not JSON)
        return f"{protocol.TOOL_CALL_START}{body}{protocol.TOOL_CALL_END}"
    return "".join(_kimi_block(c.group(1), c.group(2), bool(c.group(3))) for c in calls)


def _kimi_block(call_id: str, args: str, closed: bool) -> str:
    name = kimi_tool_name(call_id)
    try:
        payload = json.dumps({"name": name, "arguments": json.loads(args)})
    except ValueError:  # passed on as it is, so that the env's parser names the problem
        payload = f'{{"name": {json.dumps(name)}, "arguments": {args}}}'
    return protocol.TOOL_CALL_START + payload + (protocol.TOOL_CALL_END if closed else "")


def kimi_tool_name(call_id: str) -> str:
    """``functions.NAME:IDX`` (Kimi's call ids) -> NAME; a bare NAME is kept."""
    name = call_id.strip().removeprefix("functions.")
    head, sep, index = name.rpartition(":")
    return head if sep and index.isdigit() else name


TAGS = ToolCallFormat(
    "tags", protocol.TOOL_CALL_START, protocol.TOOL_CALL_END, lambda t: t, lambda n, i: f"call_{i}"
)
KIMI = ToolCallFormat("kimi", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", kimi_to_protocol,
                      lambda n, i: f"functions.{n}:{i}")  # fmt: skip
FORMATS = (KIMI, TAGS)
"""Known formats, the most specific first."""


# ---------------------------------------------------------------------------- probes

PROBE_TOOL = protocol.tool_spec(
    "probe_tool", "A tool of the start-up probe.", {"type": "object", "properties": {"x": {"type": "string"}}}
)
_TOOLS = (PROBE_TOOL,)
_CONTEXT: tuple[Message, ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Go."},
)
_PROBE_TEXT, _PROBE_ARG, _PROBE_RESULT = "probe answer", "probe arg", "probe result"


def probe_conversation(end_of_turn: str) -> list[Message]:
    """The conversation ``check_incremental`` renders both ways: reasoning, two tool turns (one result
    holding the end-of-turn string, as untrusted output may), an env message, a final answer."""
    call = protocol.format_tool_call
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is (2 + 3) * 4?"},
        {"role": "assistant", "content": "<think>\nAdd first.\n</think>\nAdding." + call("probe_tool", {"x": "2 + 3"})},
        {"role": "tool", "name": "probe_tool", "tool_call_id": "call_0", "content": "5"},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": call("probe_tool", {"x": "5 * 4"})},
        {"role": "tool", "name": "probe_tool", "tool_call_id": "call_0", "content": f"20{end_of_turn}"},
        {"role": "assistant", "content": "<think>\nDone.\n</think>\n<answer>20</answer>"},
    ]  # fmt: skip


# ---------------------------------------------------------------------------- the renderer


class TemplateRenderer:
    """Messages <-> token ids through ``tokenizer.chat_template`` (see the module docstring)."""

    def __init__(self, tokenizer, template_check: str = "error") -> None:
        if template_check not in TEMPLATE_CHECKS:
            raise ValueError(f"template_check must be one of {TEMPLATE_CHECKS}, got {template_check!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template (chat_template.jinja, or chat_template in "
                                "tokenizer_config.json)")  # fmt: skip
        self.tokenizer = tokenizer
        self.control_ids = _control_tokens(tokenizer, {})
        self._control_id_set = frozenset(self.control_ids.values())
        self._control_strings = sorted(self.control_ids, key=len, reverse=True)
        self.format = TAGS  # call ids while the probes below find the template's format
        self._prompt, _ = self._render_text(list(_CONTEXT), _TOOLS, True)
        self.end_of_turn = self._find_end_of_turn()
        self.format = self._find_tool_format()
        self.im_end_id = self._single_token(self.end_of_turn, "ends an assistant turn")
        self.tool_call_end_id = self._single_token(self.format.end, "ends a turn's tool calls")
        self.eos_id = tokenizer.eos_token_id
        self.mismatch = check_incremental(self)
        """Why the template cannot keep token-in-token-out exactness ("" when it can)."""
        if self.mismatch:
            self._report(template_check)

    @property
    def stop_token_ids(self) -> list[int]:
        """A turn ends at the end of its tool calls, at the end-of-turn token or at EOS."""
        ids = [self.tool_call_end_id, self.im_end_id, self.eos_id]
        return [i for k, i in enumerate(ids) if i is not None and i not in ids[:k]]

    # --- whole conversations ------------------------------------------------------------------------
    def render(self, messages: list[Message], tools=None, add_generation_prompt: bool = False) -> list[int]:
        """Token ids of a conversation: the template's text, tokenized at once."""
        text, protected = self._render_text(messages, tools, add_generation_prompt)
        return self._encode(text, protected)

    def message_body(self, message: Message, tools=None) -> list[int]:
        """Ids of an assistant message as the engine samples it: from the generation prompt up to the
        end-of-turn token (excluded), its tool calls included."""
        if message.get("role") != "assistant":
            raise ValueError(f"message_body renders assistant turns (what a policy samples), got role "
                             f"{message.get('role')!r}")  # fmt: skip
        text, protected = self._render_text([*_CONTEXT, message], _TOOLS, False)
        after = self._after_prompt(text)
        end = after.rfind(self.end_of_turn)
        return self._encode(after[:end] if end >= 0 else after, protected)

    # --- incremental turns --------------------------------------------------------------------------
    def continuation_ids(self, sampled_ids: list[int], new_messages: list[Message]) -> list[int]:
        """Ids to append after a sampled assistant turn: what closes it, the new messages and the next
        generation prompt. Never re-tokenises ``sampled_ids``."""
        last = sampled_ids[-1] if sampled_ids else None
        stand_in = self._stand_in(sampled_ids if last == self.tool_call_end_id else [])
        text, protected = self._render_text([*_CONTEXT, stand_in, *new_messages], _TOOLS, True)
        after = self._after_prompt(text)
        turn_end = after.find(self.end_of_turn)
        calls_end = after.rfind(self.format.end, 0, turn_end)
        if last == self.tool_call_end_id and calls_end >= 0:
            return self._encode(after[calls_end + len(self.format.end) :], protected)
        rest = self._encode(after[turn_end + len(self.end_of_turn) :], protected)
        return rest if last == self.im_end_id else [self.im_end_id, *rest]  # cut off or at EOS: close it

    def _stand_in(self, sampled_ids: list[int]) -> Message:
        """An assistant message with the sampled turn's tool calls (names only), rendered in its place."""
        calls = self.parse_tool_calls(self.decode(sampled_ids)) if sampled_ids else []
        names = [c.name if re.fullmatch(r"[\w.\-]+", c.name) else "tool" for c in calls]
        return {"role": "assistant", "content": "".join(protocol.format_tool_call(n, {}) for n in names)}

    # --- reading sampled turns ----------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        """Text of ids in the template's format, special tokens kept."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def assistant_text(self, sampled_ids: list[int]) -> str:
        """The sampled turn in the env's message format: without the end-of-turn token, tool calls as
        ``<tool_call>`` blocks (``decode`` gives the text as sampled)."""
        end = (self.im_end_id, self.eos_id)
        ids = sampled_ids[:-1] if sampled_ids and sampled_ids[-1] in end else sampled_ids
        return self.format.to_protocol(self.decode(ids))

    def parse_tool_calls(self, text: str, tools=None) -> list[ToolCall]:
        """Tool calls of an assistant turn, in the template's format or as ``<tool_call>`` blocks
        (malformed ones carry ``.error``; never raises)."""
        return protocol.parse_tool_calls(self.format.to_protocol(text), tools)

    # --- text <-> ids -------------------------------------------------------------------------------
    def _render_text(self, messages: list[Message], tools, add_generation_prompt: bool) -> tuple[str, dict]:
        """The template's text of a conversation, and the placeholders standing for untrusted content."""
        msgs, protected = self._template_messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(msgs, tools=list(tools) if tools else None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)  # fmt: skip
        except Exception as e:  # the template's own check (e.g. roles must alternate) or a bug in it
            raise TemplateError(
                f"the chat template failed on the conversation: {type(e).__name__}: {e}"
            ) from e
        return text, protected

    def _template_messages(self, messages: list[Message]) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Messages as the template takes them: assistant tool calls as ``tool_calls`` entries (ids in the
        template's form, also on the tool messages answering them), untrusted content as placeholders."""
        out: list[dict[str, Any]] = []
        protected: dict[str, str] = {}
        ids: list[str] = []
        answered = 0
        for m in messages:
            content = m.get("content") or ""
            if not isinstance(content, str):
                raise ValueError(f"message content must be a str, got {type(content).__name__}")
            if m.get("role") == "assistant":
                out.append(self._assistant_message(m, content))
                ids, answered = [c["id"] for c in out[-1].get("tool_calls", [])], 0
                continue
            msg = {**m, "content": self._guard(content, protected)}
            if m.get("role") == "tool":
                msg["tool_call_id"] = _answered_id(m.get("tool_call_id"), ids, answered)
                answered += 1
            out.append(msg)
        return out, protected

    def _assistant_message(self, m: Message, content: str) -> dict[str, Any]:
        """An assistant message with its ``<tool_call>`` blocks (or chat-API ``tool_calls``) as entries."""
        calls = protocol.parse_tool_calls(content)
        bad = [c.error for c in calls if c.error]
        if bad:
            raise ValueError(f"assistant message has a malformed tool call: {bad[0]}")
        if calls:
            text = protocol.strip_tool_calls(content)
        else:
            text, calls = content, [_as_tool_call(c) for c in m.get("tool_calls") or []]
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = [{"id": self.format.call_id(c.name, i), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in enumerate(calls)]  # fmt: skip
        return msg

    def _guard(self, content: str, protected: dict[str, str]) -> str:
        """``content``, or a placeholder for it when its encoding would hold a control id."""
        ids = self.tokenizer.encode(content, add_special_tokens=False)
        if self._control_id_set.isdisjoint(ids) and "\ue000" not in content:
            return content
        key = f"\ue000{len(protected)}\ue001"
        protected[key] = content
        return key

    def _encode(self, text: str, protected: dict[str, str]) -> list[int]:
        """Template text -> ids; each placeholder's content encoded on its own as plain text."""
        keys = [k for k in protected if k in text]
        pieces = _split_at(text, keys) if keys else [(text, False)]
        if sorted(p for p, hit in pieces if hit) != sorted(keys):
            raise TemplateError("the chat template repeated a message's content (a placeholder for content "
                                "with control-token strings came through more than once)")  # fmt: skip
        out: list[int] = []
        for piece, hit in pieces:
            out += (self.plain_ids(protected[piece]) if hit
                    else self.tokenizer.encode(piece, add_special_tokens=False))  # fmt: skip
        return out

    def plain_ids(self, text: str) -> list[int]:
        """Encode untrusted text: control-token strings in it become ordinary text ids."""
        return plain_text_ids(self.tokenizer, text, self._control_strings, self._control_id_set)

    def _after_prompt(self, text: str) -> str:
        """``text`` after the fixed context's generation prompt (a template that renders that context
        differently once an assistant turn follows cannot be rendered incrementally)."""
        if not text.startswith(self._prompt):
            i = next(i for i, (a, b) in enumerate(zip(self._prompt, text + "\0")) if a != b)
            raise TemplateError("the chat template writes an assistant turn's start differently from its generation "
                                f"prompt (or re-renders earlier messages): {self._prompt[max(0, i - 40) : i + 40]!r} "
                                f"became {text[max(0, i - 40) : i + 40]!r}; such a template cannot be rendered "
                                "turn by turn")  # fmt: skip
        return text[len(self._prompt) :]

    # --- start-up checks ----------------------------------------------------------------------------
    def _find_end_of_turn(self) -> str:
        """The special token the template writes right after an assistant message's text."""
        text, _ = self._render_text([*_CONTEXT, {"role": "assistant", "content": _PROBE_TEXT}], _TOOLS, False)
        after = self._after_prompt(text)
        i = after.find(_PROBE_TEXT)
        if i < 0:
            raise TemplateError("the chat template drops an assistant message's content")
        close = after[i + len(_PROBE_TEXT) :]
        token = next((s for s in self._control_strings if close.startswith(s)), None)
        if token is None:
            raise TemplateError(f"an assistant turn ends with {close[:40]!r} in this template, not with a special "
                                "token the engine can stop on")  # fmt: skip
        return token

    def _find_tool_format(self) -> ToolCallFormat:
        """The template shows tools, tool calls and tool results, in a format this renderer reads."""
        if PROBE_TOOL["function"]["name"] not in self._prompt:
            raise TemplateError("the chat template ignores `tools`: it cannot show the model its tools")
        call = {"role": "assistant", "content": protocol.format_tool_call("probe_tool", {"x": _PROBE_ARG})}
        result = {"role": "tool", "name": "probe_tool", "tool_call_id": "call_0", "content": _PROBE_RESULT}
        text, _ = self._render_text([*_CONTEXT, call, result], _TOOLS, True)
        after = self._after_prompt(text)
        if _PROBE_ARG not in after:
            raise TemplateError("the chat template does not render an assistant message's tool_calls: it cannot "
                                "express tool calls")  # fmt: skip
        if _PROBE_RESULT not in after:
            raise TemplateError("the chat template drops tool messages: it cannot express tool responses")
        fmt = next((f for f in FORMATS if f.marker in after), None)
        if fmt is None:
            raise TemplateError(f"the chat template writes tool calls as {after[:160]!r}, a format this renderer "
                                f"cannot read back (known: {', '.join(f.marker for f in FORMATS)})")  # fmt: skip
        return fmt

    def _single_token(self, token: str, role: str) -> int:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise TemplateError(f"{token!r}, which {role} in this template, is {len(ids)} tokens, not one; "
                                "the engine stops on single token ids")  # fmt: skip
        return ids[0]

    def _report(self, template_check: str) -> None:
        msg = (f"the chat template cannot keep token-in-token-out exactness: {self.mismatch}. Typical causes: "
               "it strips earlier reasoning (<think>) from past assistant turns, renders the last turn "
               "differently from earlier ones, or merges text across turns. Rollouts append ids turn by turn, "
               "so RL would train on token sequences this template never renders for the same conversation")  # fmt: skip
        if template_check == "error":
            raise TemplateError(msg + " (template_check=warn accepts that)")
        warnings.warn("WARNING: " + msg, RuntimeWarning, stacklevel=3)


def _answered_id(given: str | None, ids: list[str], position: int) -> str:
    """The template's id of the call a tool message answers: ``call_<i>`` (the env's ids) or its
    position picks one of the preceding assistant turn's calls; any other id is kept."""
    m = re.fullmatch(r"call_(\d+)", given or "")
    i = int(m.group(1)) if m else position
    return ids[i] if (m or not given) and i < len(ids) else (given or "")


def _as_tool_call(entry: Any) -> ToolCall:
    """A chat-API ``tool_calls`` entry (arguments a dict or a JSON string) as a ToolCall."""
    fn = entry.get("function", entry)
    args = fn.get("arguments", {})
    return ToolCall(fn["name"], json.loads(args) if isinstance(args, str) else args)


def check_incremental(r: TemplateRenderer, conversation: list[Message] | None = None) -> str:
    """Render ``conversation`` (default: ``probe_conversation``) turn by turn as the rollout does and
    compare, per turn, with the whole conversation up to there rendered at once. "" or the first mismatch."""
    msgs = conversation or probe_conversation(r.end_of_turn)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    ids = r.render(msgs[: turns[0]], _TOOLS, add_generation_prompt=True)
    for n, k in enumerate(turns, 1):
        sampled = r.message_body(msgs[k])
        sampled = sampled if sampled[-1:] == [r.tool_call_end_id] else [*sampled, r.im_end_id]
        end = turns[n] if n < len(turns) else len(msgs)
        if end == k + 1:  # nothing follows: the turn must be the start of the whole rendering's last one
            ids, want = ids + sampled, r.render(msgs[:end], _TOOLS)[: len(ids) + len(sampled)]
        else:
            ids = ids + sampled + r.continuation_ids(sampled, msgs[k + 1 : end])
            want = r.render(msgs[:end], _TOOLS, add_generation_prompt=True)
        if ids != want:
            return _first_difference(r, n, ids, want)
    return ""


def _first_difference(r: TemplateRenderer, turn: int, got: list[int], want: list[int]) -> str:
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    window = lambda ids: r.decode(ids[max(0, i - 8) : i + 12])
    return (f"after assistant turn {turn} the ids appended turn by turn differ from the conversation rendered "
            f"at once at token {i} (of {len(got)} vs {len(want)}): turn by turn {window(got)!r}, at once "
            f"{window(want)!r}")  # fmt: skip


# ---------------------------------------------------------------------------- loading


def load_hf_tokenizer(path: str | Path):
    """The Hugging Face tokenizer in ``path`` (its chat template included); TemplateError naming what
    is missing."""
    p = Path(path)
    if not p.is_dir():
        raise TemplateError(f"{p} is not a directory")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise TemplateError(f"{p} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:  # no remote code (and no prompt asking for it): the driver and the engines load the same files
        return AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        if "trust_remote_code" in why:
            why = ("it needs remote code (auto_map in tokenizer_config.json), which is not supported: save it as a "
                   "fast tokenizer (tokenizer.json) first")  # fmt: skip
        raise TemplateError(f"the tokenizer in {p} does not load: {why}") from None


@functools.lru_cache(maxsize=8)
def load_renderer(tokenizer_dir: str | None = None, template_check: str = "error"):
    """The renderer of a run: ``ChatRenderer`` over the project's tiny tokenizer (``tokenizer_dir``
    None), else a ``TemplateRenderer`` over the tokenizer and chat template in ``tokenizer_dir``."""
    if tokenizer_dir is None:
        from rollout.renderer import ChatRenderer

        return ChatRenderer()
    return TemplateRenderer(load_hf_tokenizer(tokenizer_dir), template_check)
