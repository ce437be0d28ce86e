"""The tool-call protocol, in one place: tags, parsing, argument validation, formatting.

An assistant turn calls tools by embedding blocks

    <tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>

anywhere in its text (several blocks = several calls, executed in order). The environment answers
each call with one ``role="tool"`` message whose content is the tool's text result (or an error
text starting with ``"error:"``). The renderer (rollout/renderer.py) wraps tool-message contents in
``<tool_response>...</tool_response>`` and owns the chat template; nothing here knows about tokens.

A final answer is given inside ``<answer>...</answer>`` in a turn without tool calls.

Parsing never raises: every malformed block (bad JSON, missing closing tag, unknown tool, wrong
argument types, oversized payload, invalid UTF-8 or lone surrogates, too many calls) comes back as a
``ToolCall`` with ``.error`` set, which the env turns into an error observation the model can read.
Arguments may be a JSON object or (OpenAI style) a string holding one.

Argument validation implements the subset of JSON Schema that tool specs use: ``type`` (string,
integer, number, boolean, array, object, null, or a list of them), ``required``, ``properties``,
``additionalProperties`` (extra keys are rejected unless it is true), ``enum``, ``items``,
``minimum``/``maximum``, ``maxLength``. Booleans are not integers here (unlike Python).
"""

from __future__ import annotations

import json
import re
from typing import Any

from envs.types import Message, ToolCall

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
ANSWER_START = "<answer>"
ANSWER_END = "</answer>"

MAX_CALL_BYTES = 16_384
"""Default limit on one call's JSON payload (UTF-8 bytes)."""
MAX_CALLS = 8
"""Default limit on calls per turn; later calls come back with an error."""

_ANSWER_RE = re.compile(re.escape(ANSWER_START) + r"(.*?)" + re.escape(ANSWER_END), re.DOTALL)


# --- specs --------------------------------------------------------------------------------------------
def tool_spec(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool spec in the common chat-API format."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _spec_table(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    if tools is None:
        return None
    table = {}
    for t in tools:
        fn = t.get("function", t)
        table[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return table


# --- parsing ------------------------------------------------------------------------------------------
def parse_tool_calls(
    text: str | bytes,
    tools: list[dict[str, Any]] | None = None,
    max_bytes: int = MAX_CALL_BYTES,
    max_calls: int = MAX_CALLS,
) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text``, parsed and (when ``tools`` is given) validated.

    Calls get ids ``call_0, call_1, ...`` in order. Malformed blocks come back with ``.error`` set
    and ``name``/``arguments`` filled as far as they could be read. Text without any
    ``<tool_call>`` tag gives ``[]``. A stray ``</tool_call>`` with no opening tag is ignored.
    """
    text, decode_error = _as_text(text)
    if decode_error:
        return [ToolCall(name="", arguments={}, id="call_0", error=decode_error)]
    table = _spec_table(tools)
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) != -1:
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        call_id = f"call_{len(calls)}"
        if end == -1:
            calls.append(ToolCall("", {}, call_id, f"missing closing {TOOL_CALL_END} tag"))
            break
        pos = end + len(TOOL_CALL_END)
        if len(calls) >= max_calls:
            calls.append(ToolCall("", {}, call_id, f"too many tool calls in one turn (limit {max_calls})"))
            break
        calls.append(_parse_one(text[body_start:end], call_id, table, max_bytes))
    return calls


def _as_text(text: str | bytes) -> tuple[str, str | None]:
    if isinstance(text, bytes):
        try:
            return text.decode("utf-8"), None
        except UnicodeDecodeError as e:
            return "", f"turn is not valid UTF-8 ({e.reason} at byte {e.start})"
    if not isinstance(text, str):
        return "", f"turn must be text, got {type(text).__name__}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return "", f"turn is not valid UTF-8 (lone surrogate at character {e.start})"
    return text, None


def _parse_one(body: str, call_id: str, table: dict[str, dict] | None, max_bytes: int) -> ToolCall:
    size = len(body.encode("utf-8"))
    if size > max_bytes:
        return ToolCall("", {}, call_id, f"tool call payload too large ({size} bytes, limit {max_bytes})")
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        msg = (
            e.msg
            if isinstance(e, json.JSONDecodeError)
            else "nested too deeply"
            if isinstance(e, RecursionError)
            else str(e)
        )
        return ToolCall("", {}, call_id, f"tool call is not valid JSON ({msg})")
    if not isinstance(obj, dict):
        return ToolCall("", {}, call_id, 'tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, call_id, 'tool call needs a "name" string')
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=_reject_constant) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return ToolCall(name, {}, call_id, f"arguments string is not valid JSON ({getattr(e, 'msg', e)})")
    if not isinstance(args, dict):
        return ToolCall(name, {}, call_id, f"arguments must be a JSON object, got {_json_type(args)}")
    extra = set(obj) - {"name", "arguments", "id", "type"}
    if extra:
        return ToolCall(name, args, call_id, f"unexpected keys in tool call: {sorted(extra)}")
    if table is not None:
        if name not in table:
            return ToolCall(name, args, call_id, f"unknown tool {name!r}; available: {sorted(table)}")
        problem = validate_arguments(args, table[name])
        if problem:
            return ToolCall(name, args, call_id, f"invalid arguments for {name}: {problem}")
    return ToolCall(name, args, call_id)


# --- validation ---------------------------------------------------------------------------------------
_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _json_type(v: Any) -> str:
    if _TYPES["integer"](v):
        return "integer"
    return next((t for t, ok in _TYPES.items() if ok(v)), type(v).__name__)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def validate_arguments(value: Any, schema: dict[str, Any], path: str = "arguments") -> str | None:
    """The first violation of ``schema`` by ``value`` as a readable sentence, or None."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_TYPES.get(t, lambda v: False)(value) for t in types):
            return f"{path} must be {' or '.join(types)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path} must be one of {schema['enum']}, got {value!r}"
    if isinstance(value, str) and "maxLength" in schema and len(value) > schema["maxLength"]:
        return f"{path} is longer than {schema['maxLength']} characters"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{path} must be >= {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{path} must be <= {schema['maximum']}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            if problem := validate_arguments(item, schema["items"], f"{path}[{i}]"):
                return problem
    if isinstance(value, dict):
        return _validate_object(value, schema, path)
    return None


def _validate_object(value: dict[str, Any], schema: dict[str, Any], path: str) -> str | None:
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
        return f"{path} is missing required key(s) {missing}"
    if schema.get("additionalProperties", False) is not True:
        extra = sorted(set(value) - set(props))
        if extra:
            return f"{path} has unexpected key(s) {extra}; allowed: {sorted(props)}"
    for key, sub in props.items():
        if key in value and (problem := validate_arguments(value[key], sub, f"{path}.{key}")):
            return problem
    return None


# --- formatting ---------------------------------------------------------------------------------------
def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text block that calls ``name`` (the same bytes the renderer writes for a tool_calls entry)."""
    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_END}"


def format_answer(answer: Any) -> str:
    return f"{ANSWER_START}{answer}{ANSWER_END}"


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` block, stripped; None when there is none."""
    if not isinstance(text, str):
        return None
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def strip_tool_calls(text: str) -> str:
    """``text`` without its complete ``<tool_call>`` blocks."""
    return re.sub(re.escape(TOOL_CALL_START) + r".*?" + re.escape(TOOL_CALL_END), "", text, flags=re.DOTALL)


def tool_response_message(content: str, name: str = "", tool_call_id: str = "") -> Message:
    """The ``role="tool"`` message answering one call (content is the raw result; no tags)."""
    return {"role": "tool", "name": name, "tool_call_id": tool_call_id, "content": content}


def tool_error_message(call: ToolCall, error: str | None = None) -> Message:
    """An error observation for a malformed or failed call; the text starts with ``error:``."""
    return tool_response_message(f"error: {error or call.error}", call.name, call.id)


def format_tool_response(content: str) -> str:
    """A tool result as the text the template shows the model (for renderers that work on text)."""
    return f"{TOOL_RESPONSE_START}{content}{TOOL_RESPONSE_END}"
