"""ToolEnv: a Gymnasium environment in message space, for multi-turn tool calling.

Contract (every built-in env and every plug-in env follows it):

* ``reset(seed=None, options=None) -> (obs, info)``.
  ``obs = {"messages": [...opening chat messages...], "tools": [...tool specs...]}``; tool specs are
  JSON-schema functions in the chat-API format ``{"type": "function", "function": {"name",
  "description", "parameters"}}``. ``options`` (all optional):
  ``split`` ("train" | "test", default: the env's ``split``), ``difficulty`` (int >= 1, default: the
  env's ``difficulty``), ``task_index`` (int >= 0: the n-th task of that split/difficulty) or
  ``task_id`` (a string returned in an earlier ``info["task_id"]``). Without ``task_index``/
  ``task_id`` the index is drawn from ``self.np_random``, so the same seed and options give the same
  task. Train and test tasks are disjoint (a stable hash of each task's key decides its split).
  ``info`` carries ``task_id``, ``split``, ``difficulty``, ``target`` (the reference answer as text)
  and env-specific task facts (``info["task"]``).
* ``step(action) -> (obs, reward, terminated, truncated, info)``.
  ``action`` is the assistant turn: a ``str`` (text with ``<tool_call>...</tool_call>`` blocks, see
  envs/protocol.py) or a chat message dict ``{"role": "assistant", "content": str, "tool_calls":
  [...]}`` (chat-API ``tool_calls`` entries are used when the text has no tags). ``obs`` has the
  same structure as at reset, with only the NEW messages (one ``role="tool"`` message per call, in
  call order; or a ``role="user"`` error message when the action itself is unusable) and the tool
  specs. A turn with tool calls continues the episode; a turn without tool calls is the final
  answer (``<answer>...</answer>``) and terminates it with ``reward = 1.0`` if solved else ``0.0``
  (plus any per-turn reward the env defines). ``truncated`` is True when ``max_turns`` turns were
  used without terminating. Malformed input never raises: it becomes an error observation whose
  text starts with ``error:``.
  ``info`` on every step: ``task_id``, ``turn``, ``tool_calls`` (names), ``tool_errors`` (texts);
  on a step where a tool raised something other than ``ToolError`` or a timeout (a bug in the
  tool, not a bad request) also ``tool_crashes``: one dict per such call (``tool``, ``error``, ``location``, ``code``, ``traceback``;
  the model still sees only ``error: tool <name> failed: ...``), which the driver writes to errors.jsonl.
  At the episode end (terminated or truncated) also: ``target``, ``answer`` (the model's extracted
  answer or None), ``solved`` (bool), ``num_tool_calls``, ``num_tool_errors``, plus env extras.
* Tool time budgets (constructor ``turn_tool_budget_s`` / ``episode_tool_budget_s``, defaults per
  env class, unlimited here): a turn's calls share a deadline, the sooner of the per-turn budget
  and what the episode budget has left; a call that would start past it is not run (``error:``
  observation naming the budget), ``astep`` cuts calls at it, and tools may read
  ``tool_time_left()`` to stop themselves in time. ``tool_time_used_s`` is the episode's tool wall
  time so far (not in ``info``: infos stay deterministic for a seed and actions).
* ``async astep(action)``: the same, with tool calls run off the event loop (latency-bound tools
  overlap across episodes); ``gather_steps(envs, actions)`` steps many episodes concurrently.
* ``expert_action() -> str``: the scripted expert's next assistant turn for the current state;
  feeding it back through ``step`` solves the task (warm-start data, tests).
* ``render()`` with ``render_mode="ansi"``: the conversation so far as text.

Subclasses implement ``make_tools``, ``generate_task`` and ``expert_action``; they may override
``score_answer``, ``task_key`` and ``on_tool_result`` (e.g. to end the episode from a tool).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import gymnasium
import numpy as np

from envs import protocol
from envs.spaces import AssistantTurnSpace, MessagesSpace
from envs.tracebacks import exception_info
from envs.types import Message, ToolCall

SPLITS = ("train", "test")
MAX_RESULT_CHARS = 4000
"""Tool results longer than this are cut (with a note), so one call cannot flood the context."""


class ToolError(Exception):
    """Raised by a tool for a bad request; the model sees ``error: <tool>: <message>``."""


@dataclass
class Tool:
    """A tool the env offers: its JSON schema and the function that runs it.

    ``fn(**arguments) -> str`` may be sync or ``async``; arguments are validated against
    ``parameters`` before the call. A raised exception becomes an ``error:`` observation.
    ``stateful`` tools change the env state and run strictly in call order.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str | Awaitable[str]]
    stateful: bool = False
    timeout_s: float = 30.0

    @property
    def spec(self) -> dict[str, Any]:
        return protocol.tool_spec(self.name, self.description, self.parameters)


@dataclass
class Task:
    """One task: the opening messages and the reference answer, plus facts the env/expert need."""

    key: str  # canonical content; its hash decides the split
    messages: list[Message]
    target: str
    data: dict[str, Any] = field(default_factory=dict)


class StepResult(NamedTuple):
    obs: dict[str, Any]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@dataclass
class CallOutcome:
    message: Message
    error: str | None = None
    crash: dict[str, str] | None = None
    """A tool that raised something other than ``ToolError`` or a timeout (a bug, not a bad request):
    ``envs.tracebacks.exception_info`` plus ``tool``, reported in the step's ``info["tool_crashes"]``."""


@dataclass
class _ToolClock:
    """Tool wall time of one episode: the running turn's deadline and what earlier turns used."""

    used_s: float = 0.0
    turn_start: float = 0.0
    deadline: float = math.inf
    budget: str = ""  # the budget that sets the deadline, in words


class ToolEnv(gymnasium.Env):
    """Base class of message-space tool environments (see the module docstring for the contract)."""

    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 (gymnasium convention)
    env_name = "ToolEnv"
    default_max_turns = 8
    test_fraction = 0.2
    default_turn_tool_budget_s: float = math.inf
    default_episode_tool_budget_s: float = math.inf

    def __init__(
        self,
        split: str = "train",
        difficulty: int = 1,
        max_turns: int | None = None,
        max_call_bytes: int = protocol.MAX_CALL_BYTES,
        max_calls_per_turn: int = protocol.MAX_CALLS,
        render_mode: str | None = None,
        turn_tool_budget_s: float | None = None,
        episode_tool_budget_s: float | None = None,
    ):
        _check_split(split)
        _check_difficulty(difficulty)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} not in {self.metadata['render_modes']}")
        self.split, self.difficulty, self.render_mode = split, difficulty, render_mode
        self.max_turns = max_turns or self.default_max_turns
        self.max_call_bytes, self.max_calls_per_turn = max_call_bytes, max_calls_per_turn
        self.turn_tool_budget_s = _check_budget(
            "turn_tool_budget_s", turn_tool_budget_s, self.default_turn_tool_budget_s
        )
        self.episode_tool_budget_s = _check_budget(
            "episode_tool_budget_s", episode_tool_budget_s, self.default_episode_tool_budget_s
        )
        self._tool_clock = _ToolClock()
        self.observation_space = MessagesSpace()
        self.action_space = AssistantTurnSpace()
        self.tools = {t.name: t for t in self.make_tools()}
        self.tool_specs = [t.spec for t in self.tools.values()]
        self.task: Task | None = None
        self.messages: list[Message] = []
        self.turn = 0
        self.done = False
        self._stats = {"num_tool_calls": 0, "num_tool_errors": 0}
        self._task_info: dict[str, Any] = {}

    # --- to implement -------------------------------------------------------------------------------
    def make_tools(self) -> list[Tool]:
        raise NotImplementedError

    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        """A random task of this difficulty; called repeatedly until one lands in the wanted split."""
        raise NotImplementedError

    def expert_action(self) -> str:
        raise NotImplementedError

    def score_answer(self, answer: str | None) -> bool:
        return answer is not None and self.task is not None and answer.strip() == self.task.target

    def on_tool_result(self, call: ToolCall, result: str) -> bool:
        """Hook after each successful call; return True to terminate the episode (e.g. game over)."""
        return False

    def step_info(self) -> dict[str, Any]:
        """Env-specific extras merged into every step's (and reset's) info."""
        return {}

    def final_info(self) -> dict[str, Any]:
        """Env-specific extras merged into the episode-end info."""
        return {}

    # --- tasks --------------------------------------------------------------------------------------
    def task_for(self, split: str, difficulty: int, index: int) -> Task:
        """The ``index``-th task of ``split`` at ``difficulty``: a pure function of its arguments."""
        _check_split(split)
        _check_difficulty(difficulty)
        name_seed = int.from_bytes(hashlib.sha256(self.env_name.encode()).digest()[:4], "little")
        rng = np.random.default_rng([name_seed, SPLITS.index(split), difficulty, index])
        for _ in range(10_000):
            task = self.generate_task(rng, difficulty)
            if self.split_of(task.key) == split:
                return task
        raise RuntimeError(f"{self.env_name}: no {split} task found at difficulty {difficulty}")

    def split_of(self, key: str) -> str:
        h = int.from_bytes(hashlib.sha256(f"{self.env_name}|{key}".encode()).digest()[:8], "little")
        return "test" if (h % 10_000) < self.test_fraction * 10_000 else "train"

    def _resolve_task(self, options: dict[str, Any]) -> tuple[str, int, int]:
        unknown = set(options) - {"split", "difficulty", "task_index", "task_id"}
        if unknown:
            raise ValueError(f"unknown reset option(s) {sorted(unknown)} for {self.env_name}")
        if "task_id" in options:
            return parse_task_id(options["task_id"], self.env_name)
        split = options.get("split", self.split)
        difficulty = int(options.get("difficulty", self.difficulty))
        index = options.get("task_index")
        if index is None:
            index = int(self.np_random.integers(0, 2**31 - 1))
        if not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"task_index must be an int >= 0, got {index!r}")
        return split, difficulty, int(index)

    # --- gymnasium API ------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        split, difficulty, index = self._resolve_task(dict(options or {}))
        self.task = self.task_for(split, difficulty, index)
        self.messages = copy.deepcopy(self.task.messages)
        self.turn, self.done = 0, False
        self._stats = {"num_tool_calls": 0, "num_tool_errors": 0}
        self._tool_clock = _ToolClock()
        self.on_reset()
        task_id = f"{self.env_name}/{split}/d{difficulty}/{index}"
        self._task_info = {"task_id": task_id, "split": split, "difficulty": difficulty}
        info = {**self._task_info, "target": self.task.target, "task": copy.deepcopy(self.task.data)}
        info.update(self.step_info())
        return self._obs(self.messages), info

    def on_reset(self) -> None:
        """Hook after a new task is set (per-episode state)."""

    def step(self, action: str | Message):
        text, calls, early = self._begin_step(action)
        if early is not None:
            return early
        outcomes = [self._run_call(c) for c in calls]
        return self._finish_step(text, calls, outcomes)

    async def astep(self, action: str | Message):
        text, calls, early = self._begin_step(action)
        if early is not None:
            return early
        if any(c.error is None and self.tools[c.name].stateful for c in calls):
            outcomes = [await self._arun_call(c) for c in calls]
        else:
            outcomes = list(await asyncio.gather(*(self._arun_call(c) for c in calls)))
        return self._finish_step(text, calls, outcomes)

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self.messages)

    # --- step internals -----------------------------------------------------------------------------
    def _begin_step(self, action: Any) -> tuple[str, list[ToolCall], StepResult | None]:
        """Normalise the action and parse its calls; an unusable action ends in an early result."""
        if self.task is None:
            return "", [], self._error_result("step() called before reset()", terminated=True)
        if self.done:
            return "", [], self._error_result("the episode has ended; call reset()", terminated=True)
        text, problem = action_text(action)
        self.turn += 1
        self.messages.append({"role": "assistant", "content": text if problem is None else ""})
        if problem is not None:
            return "", [], self._error_result(problem, terminated=False)
        calls = protocol.parse_tool_calls(text, self.tool_specs, self.max_call_bytes, self.max_calls_per_turn)
        self._start_tool_clock()
        return text, calls, None

    # --- tool time budgets --------------------------------------------------------------------------
    def tool_time_left(self) -> float:
        """Seconds of tool wall time left in the running turn, under the per-turn budget
        (``turn_tool_budget_s``) and what the per-episode budget (``episode_tool_budget_s``) has left.
        A call that starts with nothing left is not run; async calls are cut at the deadline; tools
        that can stop themselves (the python sandbox) shorten their own time limit to it."""
        return max(0.0, self._tool_clock.deadline - time.monotonic())

    def tool_budget_text(self) -> str:
        """The budget that bounds the running turn, in words (for error messages)."""
        return self._tool_clock.budget

    def _start_tool_clock(self) -> None:
        clock, now = self._tool_clock, time.monotonic()
        episode_left = self.episode_tool_budget_s - clock.used_s
        clock.turn_start = now
        if self.turn_tool_budget_s <= episode_left:
            clock.deadline = now + self.turn_tool_budget_s
            clock.budget = f"the per-turn tool time budget of {self.turn_tool_budget_s:g} s"
        else:
            clock.deadline = now + max(0.0, episode_left)
            clock.budget = f"the per-episode tool time budget of {self.episode_tool_budget_s:g} s"

    def _stop_tool_clock(self) -> None:
        clock = self._tool_clock
        clock.used_s += time.monotonic() - clock.turn_start
        clock.deadline = math.inf

    @property
    def tool_time_used_s(self) -> float:
        """Wall time the episode's tool calls took so far (turns with calls, start to end)."""
        return self._tool_clock.used_s

    def _over_budget(self, call: ToolCall) -> CallOutcome:
        error = f"{call.name}: not run: {self.tool_budget_text()} is used up"
        return CallOutcome(protocol.tool_error_message(call, error), error)

    def _run_call(self, call: ToolCall) -> CallOutcome:
        if call.error is not None:
            return CallOutcome(protocol.tool_error_message(call), call.error)
        if self.tool_time_left() <= 0:
            return self._over_budget(call)
        try:
            result = self.tools[call.name].fn(**call.arguments)
            if inspect.isawaitable(result):  # an async tool from sync step()
                result = _run_coroutine(result, self.tools[call.name].timeout_s)
        except Exception as e:  # a tool failure is an observation, not a crash
            return self._tool_failure(call, e)
        return self._tool_success(call, result)

    async def _arun_call(self, call: ToolCall) -> CallOutcome:
        if call.error is not None:
            return CallOutcome(protocol.tool_error_message(call), call.error)
        tool = self.tools[call.name]
        left = self.tool_time_left()
        if left <= 0:
            return self._over_budget(call)
        timeout = min(tool.timeout_s, left)
        try:
            if inspect.iscoroutinefunction(tool.fn):
                result = await asyncio.wait_for(tool.fn(**call.arguments), timeout)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments), timeout)
        except Exception as e:
            return self._tool_failure(call, e, budget_cut=timeout < tool.timeout_s)
        return self._tool_success(call, result)

    def _tool_failure(self, call: ToolCall, e: BaseException, budget_cut: bool = False) -> CallOutcome:
        if isinstance(e, ToolError):
            error = f"{call.name}: {e}"
        elif isinstance(e, TimeoutError) and budget_cut:
            error = f"tool {call.name} stopped: {self.tool_budget_text()} is used up"
        elif isinstance(e, TimeoutError):
            error = f"tool {call.name} timed out after {self.tools[call.name].timeout_s:g} s"
        else:  # the model sees the error as usual; the traceback goes to the run (info["tool_crashes"])
            error = f"tool {call.name} failed: {type(e).__name__}: {e}"
            crash = {"tool": call.name, **exception_info(e)}
            return CallOutcome(protocol.tool_error_message(call, error), error, crash)
        return CallOutcome(protocol.tool_error_message(call, error), error)

    def _tool_success(self, call: ToolCall, result: Any) -> CallOutcome:
        if not isinstance(result, str):
            result = json.dumps(result) if isinstance(result, dict | list) else str(result)
        if len(result) > MAX_RESULT_CHARS:
            result = result[:MAX_RESULT_CHARS] + f"\n[output cut at {MAX_RESULT_CHARS} characters]"
        return CallOutcome(protocol.tool_response_message(result, call.name, call.id))

    def _finish_step(self, text: str, calls: list[ToolCall], outcomes: list[CallOutcome]) -> StepResult:
        self._stop_tool_clock()
        new_messages = [o.message for o in outcomes]
        self.messages.extend(new_messages)
        errors = [o.error for o in outcomes if o.error is not None]
        self._stats["num_tool_calls"] += len(calls)
        self._stats["num_tool_errors"] += len(errors)
        ended = [
            o.error is None and self.on_tool_result(c, o.message["content"]) for c, o in zip(calls, outcomes)
        ]
        ended_by_tool = any(ended)
        info = {
            **self._task_info,
            "turn": self.turn,
            "tool_calls": [c.name for c in calls],
            "tool_errors": errors,
            **self.step_info(),
        }
        crashes = [o.crash for o in outcomes if o.crash is not None]
        if crashes:
            info["tool_crashes"] = crashes
        reward = float(self.turn_reward(calls, outcomes))
        terminated = ended_by_tool or not calls
        truncated = not terminated and self.turn >= self.max_turns
        answer = protocol.extract_answer(text) if not calls else None
        if terminated or truncated:
            self.done = True
            solved = bool(terminated and self.score_answer(answer))
            reward += float(solved)
            info.update(self._end_info(answer, solved))
        return StepResult(self._obs(new_messages), reward, terminated, truncated, info)

    def turn_reward(self, calls: list[ToolCall], outcomes: list[CallOutcome]) -> float:
        """Per-turn shaping reward (0 by default)."""
        return 0.0

    def _end_info(self, answer: str | None, solved: bool) -> dict[str, Any]:
        target = self.task.target if self.task else ""
        return {"target": target, "answer": answer, "solved": solved, **self._stats, **self.final_info()}

    def _error_result(self, problem: str, terminated: bool) -> StepResult:
        msg = {"role": "user", "content": f"error: {problem}"}
        if self.task is not None and not self.done:
            self.messages.append(msg)
        info = {**self._task_info, "turn": self.turn, "tool_calls": [], "tool_errors": [problem]}
        truncated = False
        if not terminated and self.turn >= self.max_turns:
            truncated, self.done = True, True
            info.update(self._end_info(None, False))
        return StepResult(self._obs([msg]), 0.0, terminated, truncated, info)

    def _obs(self, messages: list[Message]) -> dict[str, Any]:
        return {"messages": copy.deepcopy(messages), "tools": copy.deepcopy(self.tool_specs)}


# --- helpers ------------------------------------------------------------------------------------------
def action_text(action: Any) -> tuple[str, str | None]:
    """The assistant turn's text, or (``""``, why it is unusable). Chat-API ``tool_calls`` entries
    of a message dict are rendered as ``<tool_call>`` blocks when the text has none."""
    if isinstance(action, bytes):
        try:
            action = action.decode("utf-8")
        except UnicodeDecodeError as e:
            return "", f"assistant turn is not valid UTF-8 ({e.reason} at byte {e.start})"
    if isinstance(action, dict):
        if action.get("role", "assistant") != "assistant":
            return "", f"action message must have role 'assistant', got {action.get('role')!r}"
        content = action.get("content") or ""
        if not isinstance(content, str):
            return "", f"action message content must be a str, got {type(content).__name__}"
        calls = action.get("tool_calls") or []
        if calls and protocol.TOOL_CALL_START not in content:
            try:
                content += "".join(_chat_call_text(c) for c in calls)
            except (TypeError, ValueError, AttributeError) as e:
                return "", f"malformed tool_calls entry in action message: {e}"
        action = content
    if not isinstance(action, str):
        return "", f"action must be a str or an assistant message dict, got {type(action).__name__}"
    try:
        action.encode("utf-8")
    except UnicodeEncodeError as e:
        return "", f"assistant turn is not valid UTF-8 (lone surrogate at character {e.start})"
    return action, None


def _chat_call_text(call: Any) -> str:
    if isinstance(call, ToolCall):
        return protocol.format_tool_call(call.name, call.arguments)
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return protocol.format_tool_call(fn["name"], args)


def parse_task_id(task_id: Any, env_name: str) -> tuple[str, int, int]:
    """``"<EnvName>/<split>/d<difficulty>/<index>"`` -> (split, difficulty, index)."""
    parts = task_id.split("/") if isinstance(task_id, str) else []
    ok = len(parts) == 4 and parts[2].startswith("d") and parts[2][1:].isdigit() and parts[3].isdigit()
    if not ok or parts[0] != env_name or parts[1] not in SPLITS:
        raise ValueError(f"bad task_id {task_id!r}; expected '{env_name}/<train|test>/d<difficulty>/<index>'")
    return parts[1], int(parts[2][1:]), int(parts[3])


def _check_split(split: Any) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _check_budget(name: str, value: Any, default: float) -> float:
    """A tool time budget in seconds (None: the env's default; math.inf: unlimited)."""
    value = default if value is None else value
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds (or math.inf), got {value!r}")
    return float(value)


def _check_difficulty(difficulty: Any) -> None:
    if not isinstance(difficulty, int | np.integer) or difficulty < 1:
        raise ValueError(f"difficulty must be an int >= 1, got {difficulty!r}")


def _run_coroutine(coro: Awaitable[Any], timeout_s: float) -> Any:
    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(bounded())
    raise RuntimeError("async tool called from sync step() inside a running event loop; use astep()")


async def gather_steps(envs: Sequence[ToolEnv], actions: Sequence[str | Message]) -> list[StepResult]:
    """Step many episodes at once: their tool calls run concurrently (threads / coroutines)."""
    if len(envs) != len(actions):
        raise ValueError(f"got {len(envs)} envs but {len(actions)} actions")
    if len({id(e) for e in envs}) != len(envs):
        raise ValueError("each env may appear only once in gather_steps (an env holds one episode)")
    return list(await asyncio.gather(*(e.astep(a) for e, a in zip(envs, actions))))


def step_concurrently(envs: Sequence[ToolEnv], actions: Sequence[str | Message]) -> list[StepResult]:
    """Sync wrapper of ``gather_steps`` for code without an event loop."""
    return asyncio.run(gather_steps(envs, actions))
