"""Python: write a small function, test it with a sandboxed ``python`` tool, answer with the code.

The final answer is the code of ``solve`` inside ``<answer>...</answer>`` (Markdown fences are
allowed). Scoring runs it in the sandbox on hidden inputs; the harness prints only ``solve``'s
outputs (behind a per-run nonce) and the host compares them with the reference outputs, so the
expected values never enter the sandbox. ``info["tests_passed"]``/``["tests_total"]`` carry the
pass counts for the code-test reward; ``info["sandbox"]`` says which protections are active.
Difficulty d appends d-1 arithmetic post-steps to numeric tasks.

The sandbox (envs/sandbox.py) must be the strong bwrap backend: without it the ``python`` tool
refuses to run code (an ``error:`` observation says why) unless ``allow_weak_sandbox=True``
accepts the weak one; ``sandbox_backend`` picks a backend by name. Tool time is budgeted per turn
(``turn_tool_budget_s``, default 20 s) and per episode (``episode_tool_budget_s``, default 60 s),
on top of each call's own limits: a turn of eight 10 s calls stops at the turn's budget.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import numpy as np

from envs import protocol
from envs.base import Task, Tool, ToolEnv, ToolError
from envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, describe

SYSTEM = (
    "Write the Python function solve. Test it with the python tool, "
    "then reply with the code inside <answer></answer>."
)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _int_list(rng: np.random.Generator) -> list[Any]:
    return [[int(v) for v in rng.integers(-20, 60, size=int(rng.integers(0, 9)))]]


def _word(rng: np.random.Generator) -> list[Any]:
    return ["".join(rng.choice(list(_LETTERS[:8]), size=int(rng.integers(0, 12))))]


def _small_int(rng: np.random.Generator) -> list[Any]:
    return [int(rng.integers(0, 30))]


def _families(rng: np.random.Generator) -> list[tuple[str, str, Any, bool]]:
    """(description, body expression of solve, input generator, numeric result?) per family."""
    k, t = int(rng.integers(2, 8)), int(rng.integers(0, 40))
    c, d = (str(x) for x in rng.choice(list(_LETTERS[:8]), size=2, replace=False))
    return [
        (f"solve(xs) returns the sum of the numbers in xs divisible by {k}.",
         f"sum(x for x in xs if x % {k} == 0)", _int_list, True),
        (f"solve(xs) returns how many numbers in xs are greater than {t}.",
         f"sum(1 for x in xs if x > {t})", _int_list, True),
        (f"solve(s) returns how many times the letter '{c}' occurs in s.",
         f"s.count('{c}')", _word, True),
        (f"solve(n) returns the sum of the first n multiples of {k}.",
         f"sum({k} * i for i in range(1, n + 1))", _small_int, True),
        (f"solve(s) returns s with every '{c}' replaced by '{d}'.",
         f"s.replace('{c}', '{d}')", _word, False),
        (f"solve(xs) returns the numbers in xs greater than {t}, in order.",
         f"[x for x in xs if x > {t}]", _int_list, False),
    ]  # fmt: skip


def _arg_name(gen: Any) -> str:
    return {_int_list: "xs", _word: "s", _small_int: "n"}[gen]


class PythonEnv(ToolEnv):
    env_name = "Python"
    default_max_turns = 6
    default_turn_tool_budget_s = 20.0
    default_episode_tool_budget_s = 60.0
    num_tests = 8

    def __init__(
        self,
        *args: Any,
        sandbox_limits: SandboxLimits | dict | None = None,
        sandbox_backend: str = "auto",
        allow_weak_sandbox: bool = False,
        **kwargs: Any,
    ):
        limits = SandboxLimits(**sandbox_limits) if isinstance(sandbox_limits, dict) else sandbox_limits
        self.sandbox = Sandbox(limits, backend=sandbox_backend, allow_weak=allow_weak_sandbox)
        super().__init__(*args, **kwargs)

    def make_tools(self) -> list[Tool]:
        params = {
            "type": "object",
            "properties": {"code": {"type": "string", "maxLength": 8000}},
            "required": ["code"],
        }
        timeout = self.sandbox.limits.wall_s + 10
        return [
            Tool(
                "python",
                "Run Python code in a sandbox; returns its output.",
                params,
                self._run,
                timeout_s=timeout,
            )
        ]

    def _run(self, code: str) -> str:
        wall = min(self.sandbox.limits.wall_s, self.tool_time_left())
        try:
            result = self.sandbox.run_python(code, wall_s=wall)
        except SandboxUnavailable as e:
            raise ToolError(str(e)) from None
        text = describe(result)
        if result.timed_out and wall < self.sandbox.limits.wall_s:
            note = f"stopped after {wall:.1f} s: {self.tool_budget_text()} is used up"
            raise ToolError(f"{note}\n{text}" if text != "(no output)" else note)
        if result.reason:
            raise ToolError(f"{result.reason}\n{text}" if text != "(no output)" else result.reason)
        if result.exit_code != 0:
            raise ToolError(f"exit code {result.exit_code}\n{text}")
        return text

    def step_info(self) -> dict[str, Any]:
        return {"sandbox": dict(self.sandbox.protection)}

    # --- tasks --------------------------------------------------------------------------------------
    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        families = _families(rng)
        desc, body, gen, numeric = families[int(rng.integers(len(families)))]
        if numeric:
            for _ in range(difficulty - 1):
                m = int(rng.integers(2, 6))
                if rng.integers(2):
                    desc, body = desc[:-1] + f", multiplied by {m}.", f"({body}) * {m}"
                else:
                    desc, body = desc[:-1] + f", plus {m}.", f"({body}) + {m}"
        arg = _arg_name(gen)
        code = f"def solve({arg}):\n    return {body}\n"
        inputs = [gen(rng) for _ in range(self.num_tests)]
        outputs = _reference_outputs(code, inputs)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": desc}]
        data = {"description": desc, "inputs": inputs, "outputs": outputs, "reference": code}
        return Task(key=desc, messages=messages, target=code, data=data)

    def expert_action(self) -> str:
        code = self.task.data["reference"]
        if self.turn == 0:
            example = json.dumps(self.task.data["inputs"][0][0])
            return protocol.format_tool_call("python", {"code": f"{code}print(solve({example}))"})
        return protocol.format_answer("\n" + code)

    # --- scoring ------------------------------------------------------------------------------------
    def on_reset(self) -> None:
        self._tests = (0, len(self.task.data["inputs"]))

    def score_answer(self, answer: str | None) -> bool:
        code = extract_code(answer)
        if code is None:
            self._tests = (0, len(self.task.data["inputs"]))
            return False
        passed = run_tests(self.sandbox, code, self.task.data["inputs"], self.task.data["outputs"])
        self._tests = (passed, len(self.task.data["inputs"]))
        return passed == self._tests[1]

    def final_info(self) -> dict[str, Any]:
        return {"tests_passed": self._tests[0], "tests_total": self._tests[1]}


def _reference_outputs(code: str, inputs: list[list[Any]]) -> list[Any]:
    """Outputs of our own reference code (trusted, run in-process), JSON-normalised."""
    scope: dict[str, Any] = {}
    exec(compile(code, "<reference>", "exec"), scope)
    return [json.loads(json.dumps(scope["solve"](*args))) for args in inputs]


def extract_code(answer: str | None) -> str | None:
    if not answer or "def solve" not in answer:
        return None
    fenced = re.search(r"```(?:python)?\n(.*?)```", answer, re.DOTALL)
    return fenced.group(1) if fenced else answer


def run_tests(sandbox: Sandbox, code: str, inputs: list[list[Any]], outputs: list[Any]) -> int:
    """How many hidden cases ``code``'s ``solve`` gets right (0 if it does not run)."""
    nonce = secrets.token_hex(8)
    harness = (
        f"{code}\n\nimport json as _json\n_out = []\nfor _a in _json.loads({json.dumps(json.dumps(inputs))}):\n"
        "    try:\n        _out.append(solve(*_a))\n    except Exception as _e:\n        _out.append(None)\n"
        f"print('{nonce}' + _json.dumps(_out, default=repr))\n"
    )
    try:
        result = sandbox.run_python(harness)
    except SandboxUnavailable:  # refused: the tool calls already told the policy why
        return 0
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith(nonce)), None)
    if line is None:
        return 0
    try:
        got = json.loads(line[len(nonce) :])
    except json.JSONDecodeError:
        return 0
    return sum(1 for g, want in zip(got, outputs) if g == want)
