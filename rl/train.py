"""Entry point: ``python -m rl.train --config configs/exp/<name>.yaml [key=value ...]``.

    config ─► warm start (SFT, optional) ─► LearnerGroup ─► WeightSync ─► rollout WorkerPool
                                                 ▲                             │
    per step: train on the collected groups ─────┘ ─► sync v+1 ─► eval ─► collect with v+1 ─► checkpoint ─► log

Under ``ray job submit`` (RAY_ADDRESS set) it joins that cluster; run directly it starts a local one.
The parts: rl/launch.py (config, reward, Ray, learner group), rl/learner_group.py (the learner ranks),
rl/weight_sync.py (weights to the workers), rl/rollouts.py (the workers), rl/steps.py (one step's
phases, ``perf/*`` timings), rl/checkpoint.py + rl/rundir.py (resume), rl/summary.py (summary.json).
Curriculum stages switch context length, data mix and batch shape; needle-in-a-haystack validation runs
between stages. Outputs in ``run.dir``: config.yaml (+ config.<n>.yaml per resume), metrics.jsonl,
errors.jsonl, transcripts/, tb/, PNG plots, checkpoints/, summary.json.

Exit codes: 0 done (or a finished run re-run: its summary is printed again), 2 a config error or a
refused resume (nothing started), 3 stopped because most episodes of a step failed in the env
(``rollout.max_env_error_fraction``; checkpoints and metrics so far kept, the same command resumes),
4 finished but an evaluation failed (every held-out episode failed in the env; summary.json says so).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from rl import checkpoint
from rl.config import ConfigError, stages
from rl.errors import EXIT_CONFIG, EXIT_ENV_FAILURE, EXIT_OK, EnvFailure
from rl.launch import build_reward, connect_ray, parse, start_learner
from rl.metrics import MetricsLogger, summary_text, truncate_metrics
from rl.placement import placement_error
from rl.preflight import plan_lines
from rl.rollouts import WorkerPool, make_renderer
from rl.rundir import RunOutputs, open_run
from rl.sft import warm_start, warm_start_warnings
from rl.signal import NoSignalDetector
from rl.steps import busy_fractions, collect, niah_check, rl_step, run_eval, uses_group_stats
from rl.summary import finish
from rl.weight_sync import WeightSync


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(argv)
        rubric = build_reward(cfg.reward)
        plan = stages(cfg)
        total = sum(s.steps for s in plan)
        run = open_run(cfg, total)  # resume checks and the config history, before any actor starts
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if run.finished is not None:  # nothing to do; no row is added anywhere
        print(f"{run.path} is a finished run (step {run.state.step}); its summary:", flush=True)
        print(summary_text(run.finished), flush=True)
        return int(run.finished.get("exit_code", EXIT_OK))
    print("\n".join(plan_lines(cfg)), flush=True)  # what it trains on, before it starts anything
    connect_ray(cfg.ray, cfg.run.verbose)
    if (err := placement_error(cfg.learner, cfg.rollout)) is not None:  # GPUs the actors reserve
        print(f"config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    resume = run.resume_from
    state = (
        run.state if resume else checkpoint.RunState(init_path=warm_start(cfg, run.path, start_learner) or "")
    )
    learner = start_learner(
        cfg, dataclasses.replace(cfg.model, init_from=state.init_path or None), cfg.learner
    )
    if resume:
        learner.load(str(resume / "learner.pt"))
        truncate_metrics(run.path / "metrics.jsonl", state.step)
        print(f"resumed from {resume} (step {state.step})", flush=True)
    sync = WeightSync(learner, cfg.learner, run.path / "weights")
    renderer = make_renderer(cfg.model)  # the tokenizer the engines load from the start directory, too
    model_path, adapter, version = sync.start_weights(renderer)
    pool = WorkerPool(cfg.rollout, model_path, version, max(s.max_context_tokens for s in plan), adapter, renderer,
                      sync)  # fmt: skip
    log = MetricsLogger(
        str(run.path), total, cfg.run.tensorboard, cfg.run.progress_bar, start_step=state.step
    )
    out = RunOutputs(cfg, run.path, log.echo)
    try:
        return train(cfg, run, state, plan, learner, sync, pool, rubric, log, out)
    except EnvFailure as e:
        log.close()
        print(f"\nerror: the run stopped: {e}\n  every env failure, with its traceback: {out.errors.path}\n"
              f"  checkpoints and metrics so far are kept; fix the env and run the same command to resume",
              file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_ENV_FAILURE
    finally:
        log.close()
        sync.close()  # the nccl transport's group (a no-op for the others)
        pool.shutdown()
        learner.shutdown()


def train(cfg, run, state, plan, learner, sync, pool, rubric, log: MetricsLogger, out: RunOutputs) -> int:
    """The RL loop: per step train on the groups in hand, sync, evaluate when due, collect the next step's
    groups with the new weights, checkpoint (with those groups), log; then the final evaluation."""
    total = sum(s.steps for s in plan)
    stage_of = [s for s in plan for _ in range(s.steps)]  # stage_of[step - 1]
    signal = NoSignalDetector.from_state(state.extra.get("signal"), patience=cfg.run.no_signal_steps,
                                         grouped=uses_group_stats(cfg.algorithm))  # fmt: skip
    if not state.eval_before:
        state.eval_before = run_eval(cfg, pool, plan[0], rubric, 0, out, log)
        log.log(0, state.eval_before)
        for warning in signal.observe_eval_before(state.eval_before):
            log.warn(warning)
    first = state.step + 1
    for step in range(first, total + 1):
        t_step, stage = time.time(), stage_of[step - 1]
        if step > 1 and stage is not stage_of[step - 2] and cfg.curriculum.niah.enabled:
            log.log(step - 1, niah_check(cfg, learner, stage))  # validation between stages
        groups, metrics = state.in_flight, dict(state.in_flight_metrics)
        collected_in_step = groups is None
        if groups is None:
            groups, metrics = collect(cfg, pool, stage, step, rubric, out)
        metrics.update(rl_step(cfg, learner, sync, pool, groups, step))
        for warning in signal.observe(step, metrics):
            log.warn(warning)
        if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < total:
            metrics.update(run_eval(cfg, pool, stage, rubric, step, out, log))
        failure, nxt, nxt_metrics = None, None, {}
        try:
            if step < total:
                nxt, nxt_metrics = collect(cfg, pool, stage_of[step], step + 1, rubric, out)
        except EnvFailure as e:  # this step is trained: checkpoint it (next groups: collected anew)
            failure = e
        state = dataclasses.replace(state, step=step, in_flight=nxt, in_flight_metrics=nxt_metrics,
                                    extra={**state.extra, "signal": signal.state_dict()})  # fmt: skip
        steps_run = step - first + 1
        stop = cfg.run.stop_after_steps is not None and steps_run >= cfg.run.stop_after_steps
        if step == total or stop or failure or (cfg.run.save_every and step % cfg.run.save_every == 0):
            checkpoint.save(run.path, state, learner.save, cfg.run.keep_checkpoints)
        metrics["learner/workers_restarted"] = float(pool.restarts)
        if run.config_version:
            metrics["run/config_version"] = float(run.config_version)
        metrics["perf/step_s"] = time.time() - t_step
        metrics.update(busy_fractions(metrics, collected_in_step, nxt_metrics))
        log.log(step, metrics)
        log.advance(metrics)
        if failure is not None:
            raise failure
        if stop and step < total:
            print(f"\nstopped after {steps_run} steps (run.stop_after_steps); the same command resumes")
            return EXIT_OK
    final = run_eval(cfg, pool, plan[-1], rubric, total, out, log)
    log.log(total, final)
    if cfg.curriculum.niah.enabled:
        log.log(total, niah_check(cfg, learner, plan[-1]))
    summary = finish(
        cfg, run.path, state.eval_before, final, [*warm_start_warnings(run.path), *signal.warnings]
    )
    print(summary_text(summary), flush=True)
    return summary["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
