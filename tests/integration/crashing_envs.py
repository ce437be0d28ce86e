"""Envs that fail on purpose, named as "module:Class" strings by the failure tests."""

from envs import protocol
from envs.calculator import CalculatorEnv


class HalfCrashingCalculator(CalculatorEnv):
    """Calculator whose step raises for odd task indices (a buggy tool server, say)."""

    env_name = "HalfCrashingCalculator"

    def reset(self, *, seed=None, options=None):
        self._crash = int((options or {}).get("task_index", 0)) % 2 == 1
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._crash:
            raise ConnectionError("tool server unreachable")
        return super().step(action)


class AlwaysCrashingCalculator(CalculatorEnv):
    env_name = "AlwaysCrashingCalculator"

    def step(self, action):
        raise ConnectionError("tool server unreachable")


KILL_ON_STEP: list = []
"""Ray actor handles to kill from inside the next env step (a worker dying in the middle of a step)."""


class _SecondTurnCalculator(CalculatorEnv):
    """Calls the calculator on the first turn whatever was sampled, so the episode needs the worker again."""

    def step(self, action):
        if self.turn == 0:
            action = protocol.format_tool_call("calculator", {"expression": "1 + 1"})
        return super().step(action)


class WorkerKillingCalculator(_SecondTurnCalculator):
    env_name = "WorkerKillingCalculator"

    def step(self, action):
        if KILL_ON_STEP:
            import ray

            ray.kill(KILL_ON_STEP.pop())
        return super().step(action)


BREAK_ENGINE_ON_STEP: list = []
"""Ray actor handles of rollout workers whose vLLM engine is to raise from the next env step on (an engine that
fails mid-turn, as vLLM 0.26's scheduler did on an H200 with ``Invalid request status: RUNNING``)."""


class EngineBreakingCalculator(_SecondTurnCalculator):
    env_name = "EngineBreakingCalculator"

    def step(self, action):
        if BREAK_ENGINE_ON_STEP:
            import ray

            def break_engine(worker) -> None:  # runs in the worker's actor (shipped by value: a closure)
                def step():
                    raise RuntimeError("Invalid request status: RUNNING")

                worker.engine.step = step

            ray.get(BREAK_ENGINE_ON_STEP.pop().__ray_call__.remote(break_engine))
        return super().step(action)


class UnbuildableCalculator(CalculatorEnv):
    """A held-out env whose constructor raises (a missing data file, say)."""

    env_name = "UnbuildableCalculator"

    def __init__(self, **kwargs):
        raise FileNotFoundError("test set not found: /nonexistent/tasks.jsonl")
