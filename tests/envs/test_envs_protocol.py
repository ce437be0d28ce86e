"""The tool-call protocol: parsing, validation, formatting (table-driven)."""

import json

import pytest

from envs import protocol
from envs.protocol import format_tool_call, parse_tool_calls, tool_spec, validate_arguments

CALC = tool_spec(
    "calculator",
    "d",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "maxLength": 50}},
        "required": ["expression"],
    },
)
LIST_TOOL = tool_spec(
    "sum",
    "d",
    {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "integer"}},
            "mode": {"type": "string", "enum": ["a", "b"]},
            "k": {"type": ["integer", "null"], "minimum": 0},
        },
        "required": ["xs"],
    },
)
TOOLS = [CALC, LIST_TOOL]


def call(body: str) -> str:
    return f"{protocol.TOOL_CALL_START}{body}{protocol.TOOL_CALL_END}"


def test_roundtrip_and_ids():
    text = (
        "think "
        + format_tool_call("calculator", {"expression": "1 + 2"})
        + format_tool_call("sum", {"xs": [1]})
    )
    calls = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments, c.id, c.error) for c in calls] == [
        ("calculator", {"expression": "1 + 2"}, "call_0", None),
        ("sum", {"xs": [1]}, "call_1", None),
    ]
    assert format_tool_call("a", {"b": 1}) == '<tool_call>{"name": "a", "arguments": {"b": 1}}</tool_call>'


def test_no_calls_and_stray_close():
    assert parse_tool_calls("just text <answer>3</answer>", TOOLS) == []
    assert parse_tool_calls("oops </tool_call> text", TOOLS) == []


def test_arguments_as_json_string_openai_style():
    (c,) = parse_tool_calls(
        call(json.dumps({"name": "calculator", "arguments": '{"expression": "2"}'})), TOOLS
    )
    assert c.error is None and c.arguments == {"expression": "2"}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (call('{"name": "calculator", "arguments": {'), "not valid JSON"),
        (call("[1, 2]"), "must be a JSON object"),
        (call('{"arguments": {}}'), 'needs a "name"'),
        (call('{"name": 7, "arguments": {}}'), 'needs a "name"'),
        (call('{"name": "rm", "arguments": {}}'), "unknown tool 'rm'"),
        (call('{"name": "calculator", "arguments": [1]}'), "arguments must be a JSON object, got array"),
        (call('{"name": "calculator", "arguments": "{bad"}'), "arguments string is not valid JSON"),
        (call('{"name": "calculator", "arguments": {"expression": 5}}'), "must be string, got integer"),
        (call('{"name": "calculator", "arguments": {}}'), "missing required key(s) ['expression']"),
        (call('{"name": "calculator", "arguments": {"expression": "1", "x": 1}}'), "unexpected key(s) ['x']"),
        (
            call('{"name": "calculator", "arguments": {"expression": "1"}, "extra": 1}'),
            "unexpected keys in tool call",
        ),
        (call('{"name": "calculator", "arguments": {"expression": "' + "1" * 60 + '"}}'), "longer than 50"),
        (
            call('{"name": "sum", "arguments": {"xs": [1, true]}}'),
            "arguments.xs[1] must be integer, got boolean",
        ),
        (call('{"name": "sum", "arguments": {"xs": [], "mode": "c"}}'), "must be one of ['a', 'b']"),
        (call('{"name": "sum", "arguments": {"xs": [], "k": -1}}'), "must be >= 0"),
        (call('{"name": "sum", "arguments": {"xs": [], "k": 1.5}}'), "must be integer or null"),
        (call('{"name": "calculator", "arguments": {"expression": NaN}}'), "NaN is not valid JSON"),
        (call('{"name": "calculator", "arguments": {"expression": 2.5}}'), "must be string, got number"),
        (call("[" * 100_000 + "]" * 100_000), "too large"),
        (call("[" * 5000 + "]" * 5000), "not valid JSON"),
        (call(""), "not valid JSON"),
        ("<tool_call>" + '{"name": "calculator", "arguments": {"expression": "1"}}', "missing closing"),
        ("bad \ud800 surrogate", "lone surrogate"),
        (b"\xff\xfe" + call("{}").encode(), "not valid UTF-8"),
    ],
)
def test_malformed_calls_come_back_with_errors(text, fragment):
    calls = parse_tool_calls(text, TOOLS)
    assert calls, "a malformed call must still be reported"
    assert any(c.error and fragment in c.error for c in calls), [c.error for c in calls]


def test_too_many_calls_are_cut_with_an_error():
    one = format_tool_call("calculator", {"expression": "1"})
    calls = parse_tool_calls(one * 20, TOOLS, max_calls=8)
    assert len(calls) == 9
    assert all(c.error is None for c in calls[:8]) and "too many tool calls" in calls[8].error


def test_oversized_payload_limit_is_configurable():
    body = json.dumps({"name": "calculator", "arguments": {"expression": "1" * 40}})
    assert parse_tool_calls(call(body), TOOLS, max_bytes=20)[0].error.startswith(
        "tool call payload too large"
    )
    assert parse_tool_calls(call(body), TOOLS, max_bytes=len(body))[0].error is None


def test_without_tools_only_the_syntax_is_checked():
    (c,) = parse_tool_calls(call('{"name": "anything", "arguments": {"x": 1}}'))
    assert c.error is None and c.name == "anything"


def test_validate_arguments_bool_is_not_int():
    assert validate_arguments(True, {"type": "integer"}) == "arguments must be integer, got boolean"
    assert validate_arguments(3, {"type": "number"}) is None
    assert validate_arguments({"a": 1}, {"type": "object", "additionalProperties": True}) is None


def test_answers_and_messages():
    assert protocol.extract_answer("a <answer> 12 </answer> b <answer>13</answer>") == "13"
    assert protocol.extract_answer("no answer") is None
    assert protocol.strip_tool_calls("a" + format_tool_call("x", {}) + "b") == "ab"
    msg = protocol.tool_response_message("42", "calculator", "call_0")
    assert msg == {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "42"}
    assert protocol.format_tool_response("42") == "<tool_response>42</tool_response>"
