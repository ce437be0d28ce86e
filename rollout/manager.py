"""``RolloutManager``: groups of G episodes per task over a set of rollout workers.

Every episode is pinned to one worker for its whole life (its KV and recurrent state live there).
Placement is load-aware: whole groups go to the least-loaded worker (group members share their
prompt, so a worker's prefix cache serves them all) while there are at least as many groups as
workers; otherwise episodes are spread one by one. A worker's load is the number of episodes
assigned in this call plus the sessions it already holds (``load()["sessions"]``).

Episode ids (the workers' session ids) are ``<id_prefix><nonce>-<counter>-<member>``: the nonce is
random per manager, so ids never repeat across collections, evaluations, retries or resumed runs
(an id that came back would continue whatever stale session a worker still holds under it after a
failed clean-up). Nothing is seeded from an id: an episode's env seed is ``seed + member``.

Workers may be plain ``RolloutWorker`` objects or Ray actor handles of it: each worker gets one
driver thread (``rollout.episode.drive_episodes``) that calls ``generate`` / ``end_sessions``
directly or through ``.remote`` + ``ray.get``. A worker that fails turns its episodes into ERROR
episodes (kept, never dropped); a rubric, if given, scores every episode (a reward function that
raises gives that episode the rubric's error reward and its text in ``info["reward_error"]``; it
never fails the collection).
"""

from __future__ import annotations

import copy
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from envs.types import Episode, EpisodeGroup
from rollout.episode import EpisodeBudget, EpisodeRun, SamplingConfig, drive_episodes
from rollout.renderer import ChatRenderer


@dataclass
class TaskSpec:
    """One task: which env (anything ``envs.make`` accepts) and the reset options that pick the task."""

    env: str
    options: dict[str, Any] = field(default_factory=dict)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    task_id: str = ""


def _is_actor(worker: Any) -> bool:
    return hasattr(getattr(worker, "generate", None), "remote")


def _call(worker: Any, method: str, *args: Any) -> Any:
    fn = getattr(worker, method)
    if _is_actor(worker):
        import ray

        return ray.get(fn.remote(*args))
    return fn(*args)


class RolloutManager:
    def __init__(
        self,
        workers: list[Any],
        budget: EpisodeBudget | None = None,
        sampling: SamplingConfig | None = None,
        renderer: ChatRenderer | None = None,
        rubric: Any = None,
        env_pool_size: int = 8,
        id_prefix: str = "",
    ) -> None:
        if not workers:
            raise ValueError("RolloutManager needs at least one worker")
        self.workers = list(workers)
        self.budget, self.sampling = budget or EpisodeBudget(), sampling or SamplingConfig()
        self.renderer = renderer or ChatRenderer()
        self.rubric = rubric
        self.env_pool_size = env_pool_size
        self.id_prefix = f"{id_prefix}{uuid.uuid4().hex[:12]}-"
        self._counter = 0

    def collect(self, tasks: list[TaskSpec], group_size: int, seed: int = 0) -> list[EpisodeGroup]:
        """Run ``group_size`` episodes of every task; one EpisodeGroup per task, in task order."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        runs = [[self._make_run(t, g, seed) for g in range(group_size)] for t in tasks]
        placement = self.place(runs)
        with ThreadPoolExecutor(max_workers=len(self.workers)) as drivers:
            futures = [
                drivers.submit(self._drive, w, placement[i])
                for i, w in enumerate(self.workers)
                if placement[i]
            ]
            for f in futures:
                f.result()
        groups = []
        for t, group_runs in zip(tasks, runs):
            episodes = [r.episode for r in group_runs]
            for ep in episodes:
                self._score(ep)
            groups.append(EpisodeGroup(t.task_id or episodes[0].task_id, episodes))
        return groups

    # --- placement ------------------------------------------------------------------------------------
    def worker_loads(self) -> list[int]:
        loads = []
        for w in self.workers:
            try:
                loads.append(int(_call(w, "load").get("sessions", 0)))
            except Exception:
                loads.append(0)
        return loads

    def place(self, runs: list[list[EpisodeRun]]) -> list[list[EpisodeRun]]:
        """Episodes per worker (each episode on exactly one)."""
        loads = self.worker_loads()
        out: list[list[EpisodeRun]] = [[] for _ in self.workers]
        units = runs if len(runs) >= len(self.workers) else [[r] for g in runs for r in g]
        for unit in sorted(units, key=len, reverse=True):
            i = min(range(len(self.workers)), key=lambda k: loads[k])
            out[i].extend(unit)
            loads[i] += len(unit)
        return out

    # --- running --------------------------------------------------------------------------------------
    def _make_run(self, task: TaskSpec, member: int, seed: int) -> EpisodeRun:
        from envs.registry import make

        self._counter += 1
        episode_id = f"{self.id_prefix}{self._counter:06d}-{member}"
        try:
            env = make(task.env, **task.env_kwargs)
        except Exception as e:  # an env that cannot even be built is an ERROR episode
            run = EpisodeRun.broken(
                "env.make",
                e,
                self.renderer,
                self.budget,
                self.sampling,
                episode_id=episode_id,
                task_id=task.task_id,
                env_id=task.env,
            )
            run.episode.info["reset_options"] = copy.deepcopy(task.options)  # the task: never reset, no id
            return run
        return EpisodeRun(
            env,
            self.renderer,
            self.budget,
            self.sampling,
            episode_id=episode_id,
            task_id=task.task_id,
            env_id=task.env,
            reset_options=copy.deepcopy(task.options),
            seed=seed + member,
        )

    def _drive(self, worker: Any, runs: list[EpisodeRun]) -> None:
        with ThreadPoolExecutor(max_workers=self.env_pool_size) as pool:
            drive_episodes(
                runs,
                lambda reqs: _call(worker, "generate", reqs),
                lambda ids: _call(worker, "end_sessions", ids),
                pool,
            )

    def _score(self, ep: Episode) -> None:
        """The rubric's score (a failing reward function: the error reward, text in info["reward_error"])."""
        from rewards.base import Rubric

        if self.rubric is None:
            ep.reward = ep.env_reward
            return
        if isinstance(self.rubric, Rubric):
            self.rubric.apply(ep, catch_errors=True)
            return
        try:  # any object with apply(episode)
            self.rubric.apply(ep)
        except Exception as e:
            ep.info["reward_error"] = f"{type(e).__name__}: {e}"
            ep.reward = float(getattr(self.rubric, "error_reward", None) or 0.0)

    def update_weights(self, weights: Any, version: int) -> list[dict[str, Any]]:
        """Push new weights to every worker (in parallel for actors)."""
        if all(_is_actor(w) for w in self.workers):
            import ray

            return ray.get([w.update_weights.remote(weights, version) for w in self.workers])
        return [_call(w, "update_weights", weights, version) for w in self.workers]
