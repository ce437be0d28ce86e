"""A bridge that turns an existing Gymnasium env (Discrete actions) into a text tool env.

``GymBridgeEnv`` exposes the inner env's actions as one tool, ``move(direction)``, whose result is
the inner env's new state described as text. The episode ends when the inner env terminates or
truncates (or the model answers without moving); it is solved when the inner episode's total
reward reaches ``success_reward``. Subclasses say how to build the inner env for a task, how to
describe an observation, and how the expert plays.

``FrozenLakeTextEnv`` wraps ``FrozenLake`` (deterministic, ``is_slippery=False``) on random maps of
size 3 + difficulty; its expert plays a shortest path found by breadth-first search.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import gymnasium
import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

from envs import protocol
from envs.base import Task, Tool, ToolEnv
from envs.types import ToolCall


class GymBridgeEnv(ToolEnv):
    """Base bridge: one ``move`` tool over a Discrete-action inner env."""

    action_names: tuple[str, ...] = ()
    success_reward = 1.0

    def make_tools(self) -> list[Tool]:
        params = {
            "type": "object",
            "properties": {"direction": {"type": "string", "enum": list(self.action_names)}},
            "required": ["direction"],
        }
        return [Tool("move", "Take one action in the game.", params, self._move, stateful=True)]

    def make_inner(self, task: Task) -> gymnasium.Env:
        raise NotImplementedError

    def describe(self, obs: Any) -> str:
        raise NotImplementedError

    def on_reset(self) -> None:
        if getattr(self, "inner", None) is not None:
            self.inner.close()
        self.inner = self.make_inner(self.task)
        self.inner_obs, _ = self.inner.reset(seed=0)
        self.inner_return, self.inner_done = 0.0, False

    def _move(self, direction: str) -> str:
        if self.inner_done:
            return "The game is over."
        action = self.action_names.index(direction)
        self.inner_obs, reward, terminated, truncated, _ = self.inner.step(action)
        self.inner_return += float(reward)
        self.inner_done = bool(terminated or truncated)
        return self.describe(self.inner_obs)

    def on_tool_result(self, call: ToolCall, result: str) -> bool:
        return self.inner_done

    def score_answer(self, answer: str | None) -> bool:
        return self.inner_return >= self.success_reward

    def final_info(self) -> dict[str, Any]:
        return {"inner_return": self.inner_return}

    def close(self) -> None:
        if getattr(self, "inner", None) is not None:
            self.inner.close()


class FrozenLakeTextEnv(GymBridgeEnv):
    env_name = "FrozenLake"
    default_max_turns = 30
    action_names = ("left", "down", "right", "up")  # FrozenLake's action order

    def generate_task(self, rng: np.random.Generator, difficulty: int) -> Task:
        size = 3 + difficulty
        desc = generate_random_map(size=size, p=0.8, seed=int(rng.integers(2**31)))
        grid = "\n".join(desc)
        user = (
            "You are P on a frozen lake. Reach G and avoid the holes H. "
            f"Use the move tool (left, down, right, up).\n{grid.replace('S', 'P', 1)}"
        )
        system = "Play the game with the move tool. Stop calling tools when the game is over."
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return Task(key=grid, messages=messages, target="G", data={"map": list(desc)})

    def make_inner(self, task: Task) -> gymnasium.Env:
        return FrozenLakeEnv(desc=task.data["map"], is_slippery=False)

    def describe(self, obs: Any) -> str:
        rows = [list(r) for r in self.task.data["map"]]
        size = len(rows)
        r, c = divmod(int(obs), size)
        cell = rows[r][c]
        rows[r][c] = "P"
        rows[0][0] = "S" if (r, c) != (0, 0) else "P"
        grid = "\n".join("".join(row) for row in rows)
        status = {"H": "You fell into a hole. Game over.", "G": "You reached the goal!"}.get(cell, "")
        return f"{grid}\n{status}".rstrip()

    def _path(self) -> list[int]:
        """Shortest action sequence from the current cell to G avoiding holes (BFS)."""
        rows = self.task.data["map"]
        size = len(rows)
        start = divmod(int(self.inner_obs), size)
        prev: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
        queue = deque([start])
        moves = [(0, -1), (1, 0), (0, 1), (-1, 0)]  # left, down, right, up
        while queue:
            cur = queue.popleft()
            if rows[cur[0]][cur[1]] == "G":
                path = []
                while prev[cur] is not None:
                    cur, a = prev[cur]
                    path.append(a)
                return path[::-1]
            for a, (dr, dc) in enumerate(moves):
                nxt = (cur[0] + dr, cur[1] + dc)
                if (
                    0 <= nxt[0] < size
                    and 0 <= nxt[1] < size
                    and nxt not in prev
                    and rows[nxt[0]][nxt[1]] != "H"
                ):
                    prev[nxt] = (cur, a)
                    queue.append(nxt)
        return []

    def expert_action(self) -> str:
        path = [] if self.inner_done else self._path()
        if not path:
            return protocol.format_answer("done")
        return protocol.format_tool_call("move", {"direction": self.action_names[path[0]]})
