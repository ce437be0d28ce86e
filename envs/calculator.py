"""Calculator: multi-step integer arithmetic that the model solves through a ``calculator`` tool.

The quickstart task, so its texts are short and regular. Difficulty d chains d operations left to
right, ``((a op b) op c) ...``; the scripted expert computes one operation per tool call, feeding
each result into the next call, then answers ``<answer>N</answer>``. ``ops`` picks the operators
tasks draw from (default ``"+-*"``; the draw order is the same for every choice, so the default's task
stream does not depend on this option existing).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs import protocol
from envs.arith import calculator_tool, numbers_match
from envs.base import Task, Tool, ToolEnv

SYSTEM = "Use the calculator tool. Reply with <answer>N</answer> when done."
_OPS = ("+", "-", "*")


def _check_ops(ops: Any) -> str:
    if not isinstance(ops, str) or not ops or set(ops) - set(_OPS) or len(set(ops)) != len(ops):
        raise ValueError(
            f"Calculator ops must be a non-empty string of distinct operators from {''.join(_OPS)!r}, got {ops!r}"
        )
    return ops


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class CalculatorEnv(ToolEnv):
    env_name = "Calculator"
    default_max_turns = 8

    def __init__(self, *args: Any, ops: str = "+-*", **kwargs: Any):
        self.ops = _check_ops(ops)
        super().__init__(*args, **kwargs)

    def make_tools(self) -> list[Tool]:
        return [calculator_tool()]

    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        value = int(rng.integers(10, 100))
        text = str(value)
        steps = []
        for i in range(difficulty):
            op = self.ops[int(rng.integers(len(self.ops)))]
            b = int(rng.integers(2, 10)) if op == "*" else int(rng.integers(10, 100))
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
