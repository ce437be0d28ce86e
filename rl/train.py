"""Entry point: ``python -m rl.train --config configs/exp/<name>.yaml [key=value ...]``.

    config ─► warm start (SFT on expert trajectories, optional) ─► Learner actor ─► weights ─► rollout workers
                                                                                        │
    ┌───────────────────────────────────────────────────────────────────────────────────┘
    └─► per step: train on the collected groups ─► weight sync (version v+1) ─► eval (when due)
                  ─► collect the next step's groups with v+1 ─► checkpoint (+ those groups) ─► log

Under ``ray job submit`` (RAY_ADDRESS set) it joins that cluster; run directly it starts a local
one. Curriculum stages switch context length, data mix and batch shape; needle-in-a-haystack
validation runs between stages. Outputs in ``run.dir``: config.yaml (+ config.<n>.yaml per resume,
rl/rundir.py), metrics.jsonl, errors.jsonl (env failures, rl/errors.py), transcripts/ (sample episodes,
rl/transcripts.py), tb/, PNG plots, checkpoints/, summary.json.

Exit codes: 0 done (or a finished run re-run: its summary is printed again), 2 a config error or a
refused resume (nothing started), 3 stopped because most episodes of a step failed in the env
(``rollout.max_env_error_fraction``; checkpoints and metrics so far kept, the same command resumes),
4 finished but an evaluation failed (every held-out episode failed in the env; summary.json says so).

Per step, ``perf/*`` times the phases in seconds: ``rollout_s`` (collecting the step's groups: done during the
previous step, right after its weight sync), ``train_s`` (advantages and the learner's
update), ``sync_s`` (weight export and the workers' update), ``eval_s`` (an evaluation after the step)
and ``step_s`` (the whole step, including collecting the next step's groups and the checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from rl import checkpoint
from rl.batching import train_minibatches
from rl.config import ConfigError, RewardConfig, TrainConfig, load_config, stages
from rl.errors import EXIT_CONFIG, EXIT_ENV_FAILURE, EXIT_EVAL_FAILED, EXIT_OK, EnvFailure
from rl.metrics import MetricsLogger, summary_text, truncate_metrics, write_plots
from rl.preflight import plan_lines, preflight
from rl.rollouts import WorkerPool, collect_step, make_renderer, prepare_model_dir, run_evaluation
from rl.rundir import RunOutputs, open_run
from rl.sft import call, warm_start, warm_start_warnings
from rl.signal import NoSignalDetector


def parse(argv: list[str] | None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="python -m rl.train", description="Agentic RL post-training.")
    p.add_argument("--config", required=True, help="experiment YAML (configs/exp/...)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    preflight(cfg)
    return cfg


def build_reward(cfg: RewardConfig):
    """The run's Rubric (None without ``reward.functions``: the env reward). Every function is imported
    and its kwargs checked here, before any actor starts; a bad entry is a ConfigError naming it."""
    from rewards.base import Rubric
    from rewards.registry import reward_term

    if not cfg.functions:
        return None
    terms, seen = [], {}
    for i, f in enumerate(cfg.functions):
        key = f"reward.functions[{i}]"
        try:
            term = reward_term(f.fn, f.weight, f.name, f.kwargs)
        except (ValueError, ImportError, AttributeError, TypeError) as e:
            raise ConfigError(f"{key} (fn={f.fn!r}): {e}") from None
        if term.name in seen:
            raise ConfigError(f"{key}: name {term.name!r} is already used by reward.functions[{seen[term.name]}]; "
                              "give one of them a distinct 'name'")  # fmt: skip
        seen[term.name] = i
        terms.append(term)
    return Rubric(terms, truncated_reward=cfg.truncated_reward, error_reward=cfg.error_reward)


def connect_ray(cfg, verbose: bool = False) -> None:
    """Join or start Ray; the job's runtime env carries the console settings to every actor."""
    import ray

    from rl.console import ray_init_kwargs

    console = ray_init_kwargs(cfg.runtime_env, verbose)
    if cfg.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=cfg.address, **console)  # joins ray job submit's cluster
    else:
        ray.init(num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory, include_dashboard=False,
                 **console)  # fmt: skip


def start_learner(cfg: TrainConfig, model_cfg, learner_cfg):
    import ray

    from rl.learner import Learner

    return ray.remote(num_cpus=learner_cfg.num_cpus)(Learner).remote(model_cfg, learner_cfg, cfg.algorithm)


def niah_check(cfg: TrainConfig, learner, stage) -> dict:
    from rl.niah import niah_episodes, niah_metrics

    lengths = cfg.curriculum.niah.lengths or [stage.max_context_tokens]
    eps = {n: niah_episodes(n, cfg.curriculum.niah.num_samples, make_renderer(cfg.model)) for n in lengths}
    return niah_metrics(learner, eps)


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
    import ray

    run_dir = run.path
    stage_of = [s for s in plan for _ in range(s.steps)]  # stage_of[step - 1]
    connect_ray(cfg.ray, cfg.run.verbose)
    resume = run.resume_from
    init = None if resume else warm_start(cfg, run_dir, start_learner)
    state = run.state if resume else checkpoint.RunState(init_path=init or "")
    model_cfg = dataclasses.replace(cfg.model, init_from=state.init_path or None)
    learner = start_learner(cfg, model_cfg, cfg.learner)
    if resume:
        call(learner, "load", str(resume / "learner.pt"))
        truncate_metrics(run_dir / "metrics.jsonl", state.step)
        print(f"resumed from {resume} (step {state.step})", flush=True)
    update = call(learner, "export_weights", str(run_dir / "weights"))
    max_ctx = max(s.max_context_tokens for s in plan)
    adapter = update.path if update.adapter_only else None  # LoRA adapter sync: workers run base + adapter
    base = call(learner, "export_base_weights", str(run_dir / "weights_base")) if adapter else update
    renderer = make_renderer(cfg.model)  # the tokenizer the engines load from base.path, too
    model_path = prepare_model_dir(base.path, renderer)
    pool = WorkerPool(cfg.rollout, model_path, update.version, max_ctx, adapter, renderer)
    log = MetricsLogger(str(run_dir), total, cfg.run.tensorboard, cfg.run.progress_bar, start_step=state.step)
    signal = NoSignalDetector.from_state(state.extra.get("signal"), patience=cfg.run.no_signal_steps,
                                         grouped=uses_group_stats(cfg.algorithm))  # fmt: skip
    out = RunOutputs(cfg, run_dir, log.echo)
    steps_run = 0
    try:
        if not state.eval_before:
            state.eval_before = run_eval(cfg, pool, plan[0], rubric, 0, out, log)
            log.log(0, state.eval_before)
            for warning in signal.observe_eval_before(state.eval_before):
                log.warn(warning)
        for step in range(state.step + 1, total + 1):
            t_step = time.time()
            stage = stage_of[step - 1]
            if step > 1 and stage is not stage_of[step - 2] and cfg.curriculum.niah.enabled:
                log.log(step - 1, niah_check(cfg, learner, stage))  # validation between stages
            groups, metrics = state.in_flight, dict(state.in_flight_metrics)
            if groups is None:
                groups, metrics = collect(cfg, pool, stage, step, rubric, out)
            metrics.update(rl_step(cfg, learner, pool, groups, step, run_dir))
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
            steps_run += 1
            stop = cfg.run.stop_after_steps is not None and steps_run >= cfg.run.stop_after_steps
            if step == total or stop or failure or (cfg.run.save_every and step % cfg.run.save_every == 0):
                checkpoint.save(run_dir, state, lambda p: call(learner, "save", p), cfg.run.keep_checkpoints)
            metrics["learner/workers_restarted"] = float(pool.restarts)
            if run.config_version:
                metrics["run/config_version"] = float(run.config_version)
            metrics["perf/step_s"] = time.time() - t_step
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
        summary = finish(cfg, run_dir, state.eval_before, final, [*warm_start_warnings(run_dir), *signal.warnings])
        print(summary_text(summary), flush=True)
        return summary["exit_code"]
    except EnvFailure as e:
        log.close()
        print(f"\nerror: the run stopped: {e}\n  every env failure, with its traceback: {out.errors.path}\n"
              f"  checkpoints and metrics so far are kept; fix the env and run the same command to resume",
              file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_ENV_FAILURE
    finally:
        log.close()
        pool.shutdown()
        ray.kill(learner)


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


def rl_step(cfg: TrainConfig, learner, pool, groups, step: int, run_dir: Path) -> dict:
    """Advantages -> train step -> weight sync; nothing when every group was dropped."""
    if not groups:
        return {}
    t0 = time.time()
    batches = train_minibatches(groups, cfg.algorithm, cfg.learner.micro_batch_tokens, seed=step,
                                values_fn=lambda b: call(learner, "turn_values", b))  # fmt: skip
    metrics = call(learner, "train_step", batches)
    t1 = time.time()
    update = call(learner, "export_weights", str(run_dir / "weights"))
    pool.update_weights(update.path, update.version, update.adapter_only)
    return {**metrics, "perf/train_s": t1 - t0, "perf/sync_s": time.time() - t1}


def uses_group_stats(a) -> bool:
    """The objective's baseline or scale comes from the group (zero-variance groups teach nothing)."""
    return a.baseline in ("group_mean", "leave_one_out") or a.std_norm == "group"


def finish(cfg: TrainConfig, run_dir: Path, before: dict, after: dict, warnings=()) -> dict:
    """summary.json; ``warnings`` (no learning signal, rl/signal.py) are listed in it, [] when none.

    A failed evaluation (``eval/failed``: every held-out episode failed in the env) measured nothing: its
    success and reward are null (printed as FAILED), so is the gain, ``eval_failures`` says why, and
    ``status`` is "eval_failed" with ``exit_code`` 4 (what the driver exits with, now and on a re-run)."""
    failures = {when: m.get("eval/error", "failed") for when, m in (("before", before), ("after", after))
                if m.get("eval/failed")}  # fmt: skip

    def value(m: dict, key: str):
        return None if m.get("eval/failed") else m.get(key, 0.0)

    b, a = value(before, "eval/success_rate"), value(after, "eval/success_rate")
    summary = {
        "run_dir": str(run_dir),
        "status": "eval_failed" if failures else "ok",
        "exit_code": EXIT_EVAL_FAILED if failures else EXIT_OK,
        "algorithm": cfg.algorithm.name,
        "eval_env": cfg.env.eval_env,
        "eval_tasks": cfg.env.num_eval_tasks,
        "held_out_success_before": b,
        "held_out_success_after": a,
        "held_out_success_gain_points": None if failures else 100.0 * (a - b),
        "eval_reward_before": value(before, "eval/mean"),
        "eval_reward_after": value(after, "eval/mean"),
        "eval_failures": failures,
        "warnings": list(warnings),
    }
    if cfg.run.plots:
        summary["plots"] = ", ".join(Path(p).name for p in write_plots(run_dir))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(main())
