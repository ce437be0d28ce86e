"""Small hand-built episodes for the rl tests (no env, no engine), a scripted worker and failing envs."""

from __future__ import annotations

import numpy as np

from envs.calculator import CalculatorEnv
from envs.types import Episode, EpisodeGroup, EpisodeStatus, Turn


def turn(
    prompt: list[int], sampled: list[int], logprobs=None, reward: float = 0.0, routes=None, prompt_routes=None
) -> Turn:
    lps = logprobs if logprobs is not None else [-1.0] * len(sampled)
    return Turn(
        prompt_token_ids=list(prompt),
        token_ids=list(sampled),
        logprobs=list(lps),
        reward=reward,
        routed_experts=None if routes is None else np.asarray(routes, dtype=np.uint16),
        prompt_routed_experts=None if prompt_routes is None else np.asarray(prompt_routes, dtype=np.uint16),
    )


def episode(turns: list[Turn], reward: float, eid: str = "e", task: str = "t") -> Episode:
    return Episode(
        episode_id=eid,
        task_id=task,
        env_id="fake",
        turns=turns,
        reward=reward,
        status=EpisodeStatus.COMPLETED,
    )


def group(rewards: list[float], task: str = "t", turns_per_ep: int = 1, tokens: int = 2) -> EpisodeGroup:
    eps = []
    for i, r in enumerate(rewards):
        ts = [turn([1, 2], [10 + k] * tokens) for k in range(turns_per_ep)]
        eps.append(episode(ts, r, eid=f"{task}-{i}", task=task))
    return EpisodeGroup(task_id=task, episodes=eps)


class ScriptedWorker:
    """A plain rollout worker without an engine: every turn answers ``answer`` and stops.

    It speaks the real worker's API (``generate`` / ``end_sessions`` / ``load``) so the real episode
    loop, manager and driver collection run on it; it records every session id it served.
    """

    def __init__(self, renderer, answer: str = "<answer>0</answer>") -> None:
        self.ids = [*renderer.tokenizer.encode(answer, add_special_tokens=False), renderer.im_end_id]
        self.im_end_id = renderer.im_end_id
        self.served: list[str] = []
        self.ended: set[str] = set()
        self.reopened: list[str] = []  # sessions asked for again after they were ended

    def load(self) -> dict:
        return {"sessions": 0}

    def generate(self, requests):
        from rollout.worker import TurnOutput

        out = []
        for r in requests:
            if r.session_id in self.ended:
                self.reopened.append(r.session_id)
            self.served.append(r.session_id)
            out.append(TurnOutput(
                session_id=r.session_id, token_ids=list(self.ids), logprobs=[-0.5] * len(self.ids),
                routed_experts=None, prev_token_routed_experts=None, finish_reason="stop",
                stop_token_id=self.im_end_id, policy_version=0, num_new_tokens=len(r.token_ids),
                num_computed_prompt_tokens=len(r.token_ids), reused_session=False, context_len=0,
            ))  # fmt: skip
        return out

    def end_sessions(self, session_ids) -> None:
        self.ended |= set(session_ids)


def fails_on_odd_tasks(episode) -> float:
    """A reward function that raises on tasks with an odd task index (0.5 otherwise)."""
    index = int(str(episode.info["task_id"]).rsplit("/", 1)[1])
    if index % 2:
        raise ZeroDivisionError(f"odd task {index}")
    return 0.5


class OddCrashingCalculator(CalculatorEnv):
    """Calculator whose step raises on odd task indices (a user's env with a bug; "rl_factories:...")."""

    env_name = "OddCrashingCalculator"

    def reset(self, *, seed=None, options=None):
        self._crash = int((options or {}).get("task_index", 0)) % 2 == 1
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._crash:
            raise ConnectionError("tool server unreachable")  # the line errors must point at
        return super().step(action)


class UnbuildableCalculator(CalculatorEnv):
    """Calculator whose constructor raises (a held-out env that cannot be built)."""

    env_name = "UnbuildableCalculator"

    def __init__(self, **kwargs):
        raise FileNotFoundError("test set not found: /nonexistent/tasks.jsonl")


class BuggyToolCalculator(CalculatorEnv):
    """Calculator whose tool has a bug: it raises KeyError (not a ToolError) on every call."""

    env_name = "BuggyToolCalculator"

    def make_tools(self):
        import dataclasses

        def calculator(expression: str) -> str:
            return {"ops": {}}["ops"][expression]  # the user's tool bug the errors must point at

        return [dataclasses.replace(t, fn=calculator) for t in super().make_tools()]
