"""The driver's side of rollouts: worker actors, task sampling, collection with recovery, evaluation.

Failure handling (nothing is dropped silently; every case is counted in the step's metrics):

- A rollout worker that dies mid-step, or whose engine raises mid-turn, turns its episodes into ERROR
  episodes with ``info["error_where"] == "worker.generate"`` (rollout/manager.py). The driver then replaces
  every dead worker, and every worker that answers its ping with its engine's failure
  (``RolloutWorker.get_version``), with a fresh actor on the current weights and re-runs the affected groups, up to
  ``rollout.max_episode_retries`` times; after that the step fails with the worker's error.
- An episode whose env crashed (``env.*``: its constructor, reset or step raised) stays an ERROR
  episode: it is counted (``rollout/env_errors``, and per env ``rollout/env_errors/<env>``) and kept
  out of the loss (an env fault says nothing about the policy); the driver writes it to errors.jsonl
  (rl/errors.py). When more than ``rollout.max_env_error_fraction`` of a step's episodes failed in the
  env (every one of them, at the least), the step raises ``EnvFailure`` with the first env error.
- DAPO dynamic sampling drops zero-variance groups (counted in ``rollout/dropped_groups``) and
  collects more, up to ``algorithm.max_resample_rounds`` extra rounds.
- ``signal/*`` (rl/signal.py) describes every group scored, before dynamic sampling drops any, so
  the driver can tell when a step had no learning signal at all.
- An evaluation whose every episode failed in the env measured nothing: ``run_evaluation`` says so
  (``Evaluation.failed``, ``eval/failed`` = 1, no ``eval/success_rate``), rather than reporting 0%.

Per env of the step's mix, ``reward/env/<env>/{mean,success_rate}`` (over every episode of that env),
and ``rollout/tool_crashes/<env>``: tool calls that raised something other than ``ToolError`` or a
timeout (the episode goes on, the model sees the error; the traceback goes to errors.jsonl).

Training tasks are a pure function of (seed, step, slot), so the data position after a resume is
exactly the step counter.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.types import Episode, EpisodeGroup, EpisodeStatus
from rl.advantages import keep_group
from rl.config import AlgorithmConfig, EnvConfig, ModelConfig, RolloutConfig, StageConfig
from rl.errors import EnvFailure, failure_message, is_env_failure
from rl.placement import rollout_worker_gpus
from rl.signal import signal_metrics

WORKER_FAILURE = "worker.generate"


@dataclass
class Collected:
    groups: list[EpisodeGroup]  # the groups to train on (env-error episodes removed)
    metrics: dict[str, float] = field(default_factory=dict)
    episodes: list[Episode] = field(default_factory=list)  # every episode collected, failed ones included


@dataclass
class Evaluation:
    metrics: dict[str, float | str]
    episodes: list[Episode]
    failed: str = ""
    """Why the evaluation measured nothing (every episode failed in the env); "" when it measured."""


def stage_env_kwargs(env: EnvConfig, name: str, stage: StageConfig) -> dict[str, Any]:
    kwargs = dict(env.kwargs.get(name, {}))
    if name == "NeedleHaystack" and "context_chars" not in kwargs:
        kwargs["context_chars"] = max(200, 2 * (stage.max_context_tokens or 1024) // 3)
    return kwargs


def train_tasks(env: EnvConfig, stage: StageConfig, seed: int, step: int, round_: int = 0) -> list:
    """The step's training tasks: env drawn by the stage's mix, task index drawn from the train split."""
    from rollout.manager import TaskSpec

    rng = np.random.default_rng([seed, step, round_])
    names = list(stage.mix)
    p = np.array([stage.mix[n] for n in names], dtype=np.float64)
    out = []
    for _ in range(stage.tasks_per_step):
        name = names[int(rng.choice(len(names), p=p / p.sum()))]
        opts = {"split": "train", "task_index": int(rng.integers(0, 2**31 - 1))}
        out.append(TaskSpec(env=name, options=opts, env_kwargs=stage_env_kwargs(env, name, stage)))
    return out


def eval_tasks(env: EnvConfig, stage: StageConfig) -> list:
    from rollout.manager import TaskSpec

    kwargs = stage_env_kwargs(env, env.eval_env, stage)
    return [
        TaskSpec(
            env=env.eval_env, options={"split": "test", "task_index": env.eval_offset + i}, env_kwargs=kwargs
        )
        for i in range(env.num_eval_tasks)
    ]


class WorkerPool:
    """Rollout worker actors; replaces dead ones with fresh actors on the newest weights.

    With adapter-only sync (LoRA), ``model_path`` holds the frozen base weights the engines start
    from and ``adapter_path`` the newest adapter, applied on top of them (also to a replacement worker).
    ``renderer`` is the one of the tokenizer in ``model_path`` (``make_renderer``; None: the project's),
    which every manager over these workers renders with. ``sync`` (a ``rl.weight_sync.WeightSync``) brings
    a replacement worker to the newest weights; without one the pool reapplies its adapter only.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        version: int,
        max_context_tokens: int | None = None,
        adapter_path: str | None = None,
        renderer=None,
        sync=None,
    ) -> None:
        self.cfg, self.model_path, self.version = cfg, model_path, version
        self.adapter_path, self.renderer, self.sync = adapter_path, renderer, sync
        self.max_model_len = (max_context_tokens or cfg.max_context_tokens) + cfg.max_tokens_per_turn
        self.worker_gpus = rollout_worker_gpus(cfg)  # Ray GPUs per worker (rl/placement.py), once per pool
        self.workers = [self._start(i) for i in range(cfg.num_workers)]
        self._apply_adapter(self.workers)
        self.restarts = 0

    def _start(self, i: int):
        import ray

        from rollout.worker import RolloutWorker, WorkerConfig

        if not Path(self.model_path, "tokenizer_config.json").is_file():  # weights exported after the start
            prepare_model_dir(self.model_path, self.renderer)
        wc = WorkerConfig(model_path=self.model_path, policy_version=self.version, seed=self.cfg.seed + i,
                          max_model_len=self.max_model_len, **self.cfg.engine)  # fmt: skip
        actor = ray.remote(num_cpus=self.cfg.worker_num_cpus, num_gpus=self.worker_gpus, max_restarts=0)(RolloutWorker)
        return actor.remote(wc)

    def _apply_adapter(self, workers: list) -> None:
        import ray

        if self.adapter_path is not None:
            ray.get([w.update_weights.remote(self.adapter_path, self.version, True) for w in workers])

    def update_weights(self, path: str, version: int, adapter_only: bool = False) -> None:
        """Full weights (``path`` becomes what new workers start from) or a LoRA adapter over the base."""
        import ray

        ray.get([w.update_weights.remote(path, version, adapter_only) for w in self.workers])
        self.adopt(version, path, adapter_only)

    def adopt(self, version: int, path: str | None, adapter_only: bool = False) -> None:
        """The workers now run ``version``; ``path`` (a directory sync's) is what a new worker starts from
        (full weights) or applies (an adapter); None: new workers start from the start directory."""
        if path is not None and adapter_only:
            self.adapter_path = path
        elif path is not None:
            self.model_path, self.adapter_path = path, None
        self.version = version

    def replace_dead(self) -> list[int]:
        """Ping every worker; start a fresh one in place of each that does not answer, or answers that its
        engine failed (``RolloutWorker.get_version``). The old actor is killed first: a live one holds its
        engine's memory."""
        import ray

        dead = []
        for i, w in enumerate(self.workers):
            try:
                ray.get(w.get_version.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError):
                dead.append(i)
        for i in dead:
            with contextlib.suppress(Exception):
                ray.kill(self.workers[i])
            self.workers[i] = self._start(i)
            self.restarts += 1
        if self.sync is not None:
            self.sync.pull([self.workers[i] for i in dead])
        else:
            self._apply_adapter([self.workers[i] for i in dead])
        return dead

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            with contextlib.suppress(Exception):
                ray.get(w.shutdown.remote(), timeout=30)
            ray.kill(w)


def make_manager(pool: WorkerPool, cfg: RolloutConfig, stage: StageConfig, temperature: float, rubric=None,
                 id_prefix: str = ""):  # fmt: skip
    """A manager over the pool's workers; its episode ids start with ``id_prefix`` (then a random nonce)."""
    from rollout.episode import EpisodeBudget, SamplingConfig
    from rollout.manager import RolloutManager

    budget = EpisodeBudget(max_turns=cfg.max_turns, max_tokens_per_turn=stage.max_tokens_per_turn,
                           max_episode_tokens=stage.max_context_tokens, max_wall_s=cfg.episode_timeout_s)  # fmt: skip
    sampling = SamplingConfig(temperature=temperature, top_p=cfg.top_p)
    return RolloutManager(pool.workers, budget, sampling, getattr(pool, "renderer", None), rubric=rubric,
                          id_prefix=id_prefix)  # fmt: skip


def _worker_failed(group: EpisodeGroup) -> bool:
    return any(e.info.get("error_where") == WORKER_FAILURE for e in group.episodes)


def collect_with_recovery(pool: WorkerPool, cfg: RolloutConfig, stage: StageConfig, tasks, seed: int,
                          rubric=None, label: str = "") -> tuple[list[EpisodeGroup], int]:  # fmt: skip
    """Collect groups; re-run groups hit by a dead worker on fresh workers. Returns (groups, retries)."""
    first = make_manager(pool, cfg, stage, cfg.temperature, rubric, f"{label}-" if label else "")
    groups = first.collect(tasks, stage.group_size, seed)
    retries = 0
    while any(_worker_failed(g) for g in groups):
        bad = [i for i, g in enumerate(groups) if _worker_failed(g)]
        if retries >= cfg.max_episode_retries:
            msg = next(
                e.status_detail
                for e in groups[bad[0]].episodes
                if e.info.get("error_where") == WORKER_FAILURE
            )
            raise RuntimeError(
                f"rollout worker failed {retries + 1} times in one step ({len(bad)} groups): {msg}"
            )
        retries += 1
        pool.replace_dead()
        redo = make_manager(pool, cfg, stage, cfg.temperature, rubric, f"{label}x{retries}-").collect(
            [tasks[i] for i in bad], stage.group_size, seed + 7919 * retries
        )
        for i, g in zip(bad, redo):
            groups[i] = g
    return groups, retries


def drop_env_errors(groups: list[EpisodeGroup], min_size: int) -> tuple[list[EpisodeGroup], int, str]:
    """Groups without their env-error episodes (groups left smaller than ``min_size`` are dropped)."""
    out, errors, first = [], 0, ""
    for g in groups:
        ok = [e for e in g.episodes if e.status != EpisodeStatus.ERROR]
        bad = [e for e in g.episodes if e.status == EpisodeStatus.ERROR]
        errors += len(bad)
        first = first or (bad[0].status_detail if bad else "")
        if len(ok) >= min_size:
            out.append(EpisodeGroup(g.task_id, ok))
    return out, errors, first


def collect_step(pool: WorkerPool, env: EnvConfig, rcfg: RolloutConfig, algo: AlgorithmConfig, stage: StageConfig,
                 seed: int, step: int, rubric=None) -> Collected:  # fmt: skip
    """One step's training groups (see the module docstring for failures and dynamic sampling)."""
    t0 = time.time()
    min_size = 2 if algo.baseline in ("group_mean", "leave_one_out") or algo.std_norm == "group" else 1
    kept: list[EpisodeGroup] = []
    all_groups: list[EpisodeGroup] = []
    scored: list[EpisodeGroup] = []  # without env errors, before dynamic sampling: what signal/* describes
    errors, retries, dropped = 0, 0, 0
    for round_ in range(1 + (algo.max_resample_rounds if algo.dynamic_sampling else 0)):
        tasks = train_tasks(env, stage, seed, step, round_)
        groups, r = collect_with_recovery(
            pool, rcfg, stage, tasks, seed * 1_000_003 + step * 101 + round_, rubric, f"s{step}r{round_}"
        )
        retries += r
        all_groups += groups
        usable, e, _ = drop_env_errors(groups, min_size)
        errors += e
        scored += usable
        if algo.dynamic_sampling:
            dropped += sum(not keep_group(g) for g in usable)
            usable = [g for g in usable if keep_group(g)]
        kept += usable
        if len(kept) >= stage.tasks_per_step:
            break
    episodes = [e for g in all_groups for e in g.episodes]
    failed = [e for e in episodes if is_env_failure(e)]
    if failed and (len(failed) == len(episodes) or len(failed) > rcfg.max_env_error_fraction * len(episodes)):
        raise EnvFailure(failure_message(step, failed, len(episodes), rcfg.max_env_error_fraction), episodes)
    kept = kept[: stage.tasks_per_step]
    return Collected(kept, {**episode_metrics(all_groups, fn_names=term_names(rubric)), **signal_metrics(scored),
                            **per_env_metrics(episodes), "rollout/env_errors": float(errors),
                            "rollout/worker_retries": float(retries), "rollout/dropped_groups": float(dropped),
                            "rollout/train_groups": float(len(kept)), "perf/rollout_s": time.time() - t0},
                     episodes)  # fmt: skip


def metric_name(env: str) -> str:
    """An env id as a metric path segment ("/" of gymnasium namespaces would add levels)."""
    return env.replace("/", ".")


def per_env_metrics(episodes: list[Episode]) -> dict[str, float]:
    """``reward/env/<env>/mean`` and ``/success_rate`` per env; counts: ``rollout/env_errors/<env>``
    (episodes that failed in the env) and ``rollout/tool_crashes/<env>`` (tool calls that raised a bug)."""
    by_env: dict[str, list[Episode]] = {}
    for e in episodes:
        by_env.setdefault(e.env_id, []).append(e)
    out = {}
    for env, eps in sorted(by_env.items()):
        name, n = metric_name(env), len(eps)
        out[f"reward/env/{name}/mean"] = sum(e.reward for e in eps) / n
        out[f"reward/env/{name}/success_rate"] = sum(bool(e.info.get("solved", False)) for e in eps) / n
        out[f"rollout/env_errors/{name}"] = float(sum(is_env_failure(e) for e in eps))
        out[f"rollout/tool_crashes/{name}"] = float(sum(len(t.info.get("tool_crashes") or []) for e in eps
                                                        for t in e.turns))  # fmt: skip
    return out


def term_names(rubric) -> list[str]:
    """The rubric's term names (their means become ``reward/fn/<name>``); none without a rubric."""
    return [t.name for t in getattr(rubric, "terms", None) or []]


def episode_metrics(groups: list[EpisodeGroup], prefix: str = "reward", fn_names=()) -> dict[str, float]:
    """Means over every episode; ``<prefix>/errors`` is the fraction scored with the error reward (an
    ERROR episode, or a reward function that raised). With reward functions named (``fn_names``), also
    ``<prefix>/fn/<name>`` (the function's unweighted mean over the episodes it scored) and
    ``<prefix>/fn_errors`` (episodes on which a function raised)."""
    eps = [e for g in groups for e in g.episodes]
    if not eps:
        return {}
    n = len(eps)
    out = {
        f"{prefix}/mean": sum(e.reward for e in eps) / n,
        f"{prefix}/success_rate": sum(bool(e.info.get("solved", False)) for e in eps) / n,
        f"{prefix}/turns": sum(len(e.turns) for e in eps) / n,
        f"{prefix}/sampled_tokens": sum(e.num_sampled_tokens for e in eps) / n,
        f"{prefix}/truncated": sum(e.status == EpisodeStatus.TRUNCATED for e in eps) / n,
        f"{prefix}/errors": sum(e.status == EpisodeStatus.ERROR or "reward_error" in e.info for e in eps) / n,
    }
    if fn_names:
        out[f"{prefix}/fn_errors"] = float(sum("reward_error" in e.info for e in eps))
    for name in fn_names:
        values = [e.reward_breakdown[name] for e in eps if name in e.reward_breakdown]
        if values:
            out[f"{prefix}/fn/{name}"] = sum(values) / len(values)
    return out


def run_evaluation(pool: WorkerPool, env: EnvConfig, rcfg: RolloutConfig, stage: StageConfig,
                   rubric=None) -> Evaluation:  # fmt: skip
    """Held-out success: greedy decoding, one episode per test-split task. When every episode failed in
    the env (its constructor raised, say) nothing was measured: ``failed`` says why, and the metrics are
    ``eval/failed`` = 1, ``eval/errors`` = 1 and ``eval/error`` (the first failure's text) only."""
    manager = make_manager(pool, rcfg, stage, 0.0, rubric, "eval-")
    groups = manager.collect(eval_tasks(env, stage), 1, seed=0)
    episodes = [e for g in groups for e in g.episodes]
    failed = [e for e in episodes if is_env_failure(e)]
    if episodes and len(failed) == len(episodes):
        why = f"every one of the {len(episodes)} evaluation episodes failed in the env: {failed[0].status_detail}"
        return Evaluation({"eval/failed": 1.0, "eval/errors": 1.0, "eval/error": why}, episodes, why)
    return Evaluation(episode_metrics(groups, prefix="eval", fn_names=term_names(rubric)), episodes)


def evaluate(pool: WorkerPool, env: EnvConfig, rcfg: RolloutConfig, stage: StageConfig, rubric=None) -> dict:
    """``run_evaluation``'s metrics."""
    return run_evaluation(pool, env, rcfg, stage, rubric).metrics


def make_renderer(model: ModelConfig):
    """The run's renderer (``model.tokenizer``): ``ChatRenderer`` over the project's tiny tokenizer, or a
    ``TemplateRenderer`` over the checkpoint's (or a directory's) tokenizer and chat template; one per
    directory in a process."""
    from rollout.template_renderer import load_renderer

    return load_renderer(model.tokenizer_dir(), model.template_check)


def prepare_model_dir(path: str, renderer=None) -> str:
    """Add the run's tokenizer to an exported checkpoint so an engine can start from it and loads the
    tokenizer the rollouts render with: ``renderer``'s (a ``TemplateRenderer``: saved with its chat
    template), or the project's (its asset files copied)."""
    from rollout.template_renderer import TemplateRenderer
    from rollout.tokenizer import TOKENIZER_DIR

    if isinstance(renderer, TemplateRenderer):
        renderer.tokenizer.save_pretrained(path)
        return path
    for f in Path(TOKENIZER_DIR).iterdir():
        if f.is_file():
            shutil.copy(f, Path(path) / f.name)
    return path
