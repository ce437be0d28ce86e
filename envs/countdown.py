"""Countdown: combine the given numbers with + - * / (each used at most once) to reach a target.

The ``evaluate`` tool computes a candidate expression and says how far it is from the target; the
scripted expert searches: it tries ``difficulty`` near-miss candidates before the solution, then
answers with the expression. Difficulty d gives d + 2 numbers. Division must be exact.
"""

from __future__ import annotations

import ast
from collections import Counter
from fractions import Fraction

import numpy as np

from envs import protocol
from envs.arith import format_number, safe_eval
from envs.base import Task, Tool, ToolEnv, ToolError

SYSTEM = (
    "Reach the target using the numbers, each at most once, with + - * / and parentheses. "
    "Try expressions with the evaluate tool. Reply with <answer>expression</answer>."
)
_OPS = ("+", "-", "*", "/")


def _literals(expression: str) -> list[int]:
    tree = ast.parse(expression.replace("^", "**"), mode="eval")
    nums = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in nums):
        raise ToolError("only whole numbers from the list may appear")
    return nums


def _random_expression(rng: np.random.Generator, numbers: list[int]) -> tuple[str, Fraction] | None:
    """A random expression over a random subset (>= 2) of ``numbers``; None if a division is inexact."""
    k = int(rng.integers(2, len(numbers) + 1))
    idx = rng.permutation(len(numbers))[:k]
    items = [(str(numbers[i]), Fraction(numbers[i])) for i in idx]
    while len(items) > 1:
        (ta, va), (tb, vb) = items.pop(0), items.pop(0)
        op = _OPS[int(rng.integers(len(_OPS)))]
        if op == "/" and (vb == 0 or (va / vb).denominator != 1):
            return None
        value = va + vb if op == "+" else va - vb if op == "-" else va * vb if op == "*" else va / vb
        items.insert(int(rng.integers(len(items) + 1)), (f"({ta} {op} {tb})", value))
    text, value = items[0]
    return (text[1:-1] if text.startswith("(") else text), value


class CountdownEnv(ToolEnv):
    env_name = "Countdown"
    default_max_turns = 10

    def make_tools(self) -> list[Tool]:
        params = {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 200}},
            "required": ["expression"],
        }
        return [Tool("evaluate", "Evaluate a candidate expression.", params, self._evaluate)]

    def _evaluate(self, expression: str) -> str:
        value = self._check(expression)
        target = Fraction(int(self.task.target))
        status = "target reached" if value == target else f"target is {self.task.target}"
        return f"{format_number(value)} ({status})"

    def _check(self, expression: str) -> Fraction:
        numbers = self.task.data["numbers"]
        used = _literals(expression) if len(expression) <= 200 else []
        missing = Counter(used) - Counter(numbers)
        if missing:
            raise ToolError(f"uses {sorted(missing.elements())}, not available in {numbers}")
        return safe_eval(expression)

    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        while True:
            numbers = sorted(int(v) for v in rng.integers(1, 13, size=difficulty + 2))
            found = _random_expression(rng, numbers)
            if found is None or found[1].denominator != 1 or not 10 <= found[1] <= 999:
                continue
            solution, value = found
            if int(value) in numbers:
                continue
            decoys = self._decoys(rng, numbers, value, difficulty)
            if decoys is None:
                continue
            break
        user = f"Numbers: {', '.join(map(str, numbers))}. Target: {int(value)}."
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        data = {"numbers": numbers, "solution": solution, "decoys": decoys}
        return Task(key=user, messages=messages, target=str(int(value)), data=data)

    @staticmethod
    def _decoys(rng: np.random.Generator, numbers: list[int], value: Fraction, n: int) -> list[str] | None:
        out: list[str] = []
        for _ in range(50 * n):
            cand = _random_expression(rng, numbers)
            if cand is not None and cand[1] != value and cand[0] not in out:
                out.append(cand[0])
            if len(out) == n:
                return out
        return None

    def score_answer(self, answer: str | None) -> bool:
        if answer is None or self.task is None:
            return False
        try:
            return self._check(answer) == Fraction(int(self.task.target))
        except (ToolError, SyntaxError, ValueError, RecursionError):
            return False

    def expert_action(self) -> str:
        tries = [*self.task.data["decoys"], self.task.data["solution"]]
        if self.turn < len(tries):
            return protocol.format_tool_call("evaluate", {"expression": tries[self.turn]})
        return protocol.format_answer(self.task.data["solution"])
