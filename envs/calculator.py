"""Calculator: multi-step integer arithmetic that the model solves through a ``calculator`` tool.

The quickstart task, so its texts are short and regular. Difficulty d chains d operations left to
right, ``((a op b) op c) ...``; the scripted expert computes one operation per tool call, feeding
each result into the next call, then answers ``<answer>N</answer>``. ``ops`` picks the operators
tasks draw from (default ``"+-*"``; the draw order is the same for every choice, so the default's task
stream does not depend on this option existing). ``operand_ranges`` overrides, per operator, the
inclusive ``[low, high]`` ranges of its first and second operand (defaults: two-digit operands, a
one-digit multiplier); the first operand's range applies to the task's first operation only, later
operations take the running value. The quickstart gives each operator its own shape with it (a
one-digit subtrahend for ``-``, a one-digit multiplicand for ``*``), because its tiny model tells
operators apart by the question's shape, not by the operator token (bench/RESULTS.md, "Quickstart").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from envs import protocol
from envs.arith import calculator_tool, numbers_match
from envs.base import Task, Tool, ToolEnv

SYSTEM = "Use the calculator tool. Reply with <answer>N</answer> when done."
_OPS = ("+", "-", "*")
Range = tuple[int, int]
_TWO_DIGITS: Range = (10, 99)
"""Every task's first draw, before its first operator (the default first operand of every operator)."""
_DEFAULT_RANGES: dict[str, tuple[Range, Range]] = {
    "+": (_TWO_DIGITS, _TWO_DIGITS),
    "-": (_TWO_DIGITS, _TWO_DIGITS),
    "*": (_TWO_DIGITS, (2, 9)),
}


def _check_ops(ops: Any) -> str:
    if not isinstance(ops, str) or not ops or set(ops) - set(_OPS) or len(set(ops)) != len(ops):
        raise ValueError(
            f"Calculator ops must be a non-empty string of distinct operators from {''.join(_OPS)!r}, got {ops!r}"
        )
    return ops


def _check_range(op: str, which: str, value: Any) -> Range:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value)
    if not ok or not 0 <= value[0] <= value[1]:
        raise ValueError(
            f"Calculator operand_ranges[{op!r}]: the {which} operand's range must be [low, high] with "
            f"integers 0 <= low <= high, got {value!r}"
        )
    return int(value[0]), int(value[1])


def _check_ranges(ranges: Any) -> dict[str, tuple[Range, Range]]:
    """Today's ranges with ``ranges`` (``{op: [[low, high], [low, high]]}``) laid over them."""
    if ranges is None:
        return dict(_DEFAULT_RANGES)
    if not isinstance(ranges, Mapping) or set(ranges) - set(_OPS):
        raise ValueError(
            f"Calculator operand_ranges must map operators from {''.join(_OPS)!r} to ranges, got {ranges!r}"
        )
    merged = dict(_DEFAULT_RANGES)
    for op, pair in ranges.items():
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(
                f"Calculator operand_ranges[{op!r}] must be [[low, high], [low, high]], got {pair!r}"
            )
        merged[op] = (_check_range(op, "first", pair[0]), _check_range(op, "second", pair[1]))
    return merged


def _draw(rng: np.random.Generator, bounds: Range) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class CalculatorEnv(ToolEnv):
    env_name = "Calculator"
    default_max_turns = 8

    def __init__(
        self, *args: Any, ops: str = "+-*", operand_ranges: Mapping[str, Any] | None = None, **kwargs: Any
    ):
        self.ops = _check_ops(ops)
        self.operand_ranges = _check_ranges(operand_ranges)
        super().__init__(*args, **kwargs)

    def make_tools(self) -> list[Tool]:
        return [calculator_tool()]

    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        value = _draw(rng, _TWO_DIGITS)
        steps = []
        for i in range(difficulty):
            op = self.ops[int(rng.integers(len(self.ops)))]
            first, second = self.operand_ranges[op]
            if i == 0:
                if first != _TWO_DIGITS:
                    # drawn again only when overridden: the default task stream keeps its draw order
                    value = _draw(rng, first)
                text = str(value)
            b = _draw(rng, second)
            steps.append(f"{value} {op} {b}")
            text = f"{text} {op} {b}" if i == 0 else f"({text}) {op} {b}"
            value = _apply(value, op, b)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {text}?"}]
        return Task(key=text, messages=messages, target=str(value), data={"expression": text, "steps": steps})

    def score_answer(self, answer: str | None) -> bool:
        return self.task is not None and numbers_match(answer, self.task.target)

    def expert_action(self) -> str:
        steps = self.task.data["steps"]
        if self.turn < len(steps):
            return protocol.format_tool_call("calculator", {"expression": steps[self.turn]})
        return protocol.format_answer(self.task.target)
