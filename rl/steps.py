"""One RL step's phases as the driver calls them: collect, train + sync, evaluate, NIAH validation.

Per step, ``perf/*`` times the phases in seconds: ``rollout_s`` (collecting the step's groups: done during
the previous step, right after its weight sync), ``train_s`` (advantages and the learner's update),
``sync_s`` (the weight sync of the new version, rl/weight_sync.py), ``eval_s`` (an evaluation after the
step); the driver adds ``step_s`` (the whole step, including the next step's groups and the checkpoint) and
the busy fractions of that same wall-clock window (``busy_fractions``): ``rollout_busy_frac``, the share of
the step the rollout workers were given work (the groups collected in it, the next step's and at the first
step its own, plus an evaluation after it) and ``learner_busy_frac``, the learner's share (``train_s``). In
this synchronous loop they add up to at most 1; the rest is the weight sync, the checkpoint and the driver's
own work, during which both sides wait. They are upper bounds on the devices' utilisation (within a rollout
the engines also wait for the envs) and the figure an asynchronous mode would raise. The last step's window
holds no collection (its rollout fraction is only its evaluation's, 0 without one).
"""

from __future__ import annotations

import time

from rl.batching import train_minibatches
from rl.config import TrainConfig
from rl.errors import EnvFailure
from rl.metrics import MetricsLogger
from rl.rollouts import collect_step, make_renderer, run_evaluation
from rl.rundir import RunOutputs


def collect(cfg: TrainConfig, pool, stage, step: int, rubric=None, out: RunOutputs | None = None):
    """The step's groups and metrics; its episodes recorded (env failures, transcripts) in ``out``."""
    try:
        c = collect_step(pool, cfg.env, cfg.rollout, cfg.algorithm, stage, cfg.seed, step, rubric)
    except EnvFailure as e:
        if out is not None:
            out.record(step, "train", e.episodes)
        raise
    if out is not None:
        out.record(step, "train", c.episodes)
    return c.groups, c.metrics


def run_eval(cfg: TrainConfig, pool, stage, rubric, step: int, out: RunOutputs, log: MetricsLogger) -> dict:
    """The held-out evaluation after ``step`` (0: before RL), recorded in ``out``; a failed one (every
    episode failed in the env) is said on the console at once, and the run goes on."""
    t0 = time.time()
    ev = run_evaluation(pool, cfg.env, cfg.rollout, stage, rubric)
    out.record(step, "eval", ev.episodes)
    if ev.failed:
        when = "before RL" if step == 0 else f"after step {step}"
        log.warn(f"the evaluation {when} failed: {ev.failed}. The run goes on; its summary reports the "
                 "evaluation as failed (exit code 4).")  # fmt: skip
    return {**ev.metrics, "perf/eval_s": time.time() - t0}


def rl_step(cfg: TrainConfig, learner, sync, pool, groups, step: int) -> dict:
    """Advantages -> train step -> weight sync of the new version; nothing when every group was dropped."""
    if not groups:
        return {}
    t0 = time.time()
    batches = train_minibatches(groups, cfg.algorithm, cfg.learner.micro_batch_tokens, seed=step,
                                values_fn=learner.turn_values)  # fmt: skip
    metrics = learner.train_step(batches)
    train_s = time.time() - t0
    return {**metrics, "perf/train_s": train_s, **sync.push(pool).metrics()}


def busy_fractions(
    step: dict[str, float], collected_in_step: bool, next_collect: dict[str, float]
) -> dict[str, float]:
    """``perf/rollout_busy_frac`` and ``perf/learner_busy_frac`` of one step's row (the module docstring):
    ``step`` holds its ``perf/*`` seconds, ``step_s`` included; ``collected_in_step``: its own groups were
    collected inside its window (the first step; otherwise the previous step collected them); ``next_collect``:
    the metrics of the next step's collection, done inside this window (empty at the last step)."""
    step_s = step.get("perf/step_s", 0.0)
    if step_s <= 0:
        return {}
    rollout_s = step.get("perf/eval_s", 0.0) + next_collect.get("perf/rollout_s", 0.0)
    rollout_s += step.get("perf/rollout_s", 0.0) if collected_in_step else 0.0
    return {
        "perf/rollout_busy_frac": rollout_s / step_s,
        "perf/learner_busy_frac": step.get("perf/train_s", 0.0) / step_s,
    }


def niah_check(cfg: TrainConfig, learner, stage) -> dict:
    """Needle-in-a-haystack validation (between curriculum stages and at the end)."""
    from rl.niah import niah_episodes, niah_metrics

    lengths = cfg.curriculum.niah.lengths or [stage.max_context_tokens]
    eps = {n: niah_episodes(n, cfg.curriculum.niah.num_samples, make_renderer(cfg.model)) for n in lengths}
    return niah_metrics(learner, eps)


def uses_group_stats(a) -> bool:
    """The objective's baseline or scale comes from the group (zero-variance groups teach nothing)."""
    return a.baseline in ("group_mean", "leave_one_out") or a.std_norm == "group"
