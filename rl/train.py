"""Entry point: ``python -m rl.train --config configs/exp/<name>.yaml [key=value ...]``.

    config ─► warm start (SFT on expert trajectories, optional) ─► Learner actor ─► weights ─► rollout workers
                                                                                        │
    ┌───────────────────────────────────────────────────────────────────────────────────┘
    └─► per step: train on the collected groups ─► weight sync (version v+1) ─► eval (when due)
                  ─► collect the next step's groups with v+1 ─► checkpoint (+ those groups) ─► log

Under ``ray job submit`` (RAY_ADDRESS set) it joins that cluster; run directly it starts a local
one. Curriculum stages switch context length, data mix and batch shape; needle-in-a-haystack
validation runs between stages. Outputs in ``run.dir``: config.yaml, metrics.jsonl, tb/, PNG plots,
checkpoints/, summary.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from rl import checkpoint
from rl.batching import train_minibatches
from rl.config import ConfigError, RewardConfig, TrainConfig, check_nested_keys, load_config, stages, to_yaml
from rl.metrics import MetricsLogger, summary_text, truncate_metrics, write_plots
from rl.preflight import add_runtime_env_paths, check_checkpoints, plan_lines
from rl.rollouts import WorkerPool, collect_step, evaluate, prepare_model_dir
from rl.sft import call, warm_start, warm_start_warnings
from rl.signal import NoSignalDetector


def parse(argv: list[str] | None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="python -m rl.train", description="Agentic RL post-training.")
    p.add_argument("--config", required=True, help="experiment YAML (configs/exp/...)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    add_runtime_env_paths(cfg.ray.runtime_env)  # the actors import plug-ins from there: so do the checks
    check_envs(cfg)
    check_nested_keys(cfg)  # model.arch, rollout.engine, env.kwargs.<Env>: typos there fail here, by name
    check_checkpoints(cfg)  # model.init_from is a checkpoint: seconds and one line, not an actor's traceback
    return cfg


def check_envs(cfg: TrainConfig) -> None:
    """Every env the run names must resolve now, not in an actor twenty minutes in."""
    from envs.registry import resolve_env

    names = {
        *cfg.env.mix,
        cfg.env.eval_env,
        *cfg.sft.env_mix,
        *(n for s in cfg.curriculum.stages for n in s.mix or {}),
    }
    for name in sorted(names):
        try:
            resolve_env(name)
        except (ValueError, ImportError, AttributeError) as e:
            raise ConfigError(f"env {name!r}: {e}") from None


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
    from rollout.renderer import ChatRenderer

    lengths = cfg.curriculum.niah.lengths or [stage.max_context_tokens]
    eps = {n: niah_episodes(n, cfg.curriculum.niah.num_samples, ChatRenderer()) for n in lengths}
    return niah_metrics(learner, eps)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(argv)
        rubric = build_reward(cfg.reward)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print("\n".join(plan_lines(cfg)), flush=True)  # what it trains on, before it starts anything
    import ray

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    plan = stages(cfg)
    total = sum(s.steps for s in plan)
    stage_of = [s for s in plan for _ in range(s.steps)]  # stage_of[step - 1]
    connect_ray(cfg.ray, cfg.run.verbose)
    resume = checkpoint.latest(run_dir) if cfg.run.resume else None
    init = None if resume else warm_start(cfg, run_dir, start_learner)
    state = checkpoint.load(resume) if resume else checkpoint.RunState(init_path=init or "")
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
    pool = WorkerPool(cfg.rollout, prepare_model_dir(base.path), update.version, max_ctx, adapter)
    log = MetricsLogger(str(run_dir), total, cfg.run.tensorboard, cfg.run.progress_bar, start_step=state.step)
    signal = NoSignalDetector.from_state(state.extra.get("signal"), patience=cfg.run.no_signal_steps,
                                         grouped=uses_group_stats(cfg.algorithm))  # fmt: skip
    steps_run = 0
    try:
        if not state.eval_before:
            state.eval_before = evaluate(pool, cfg.env, cfg.rollout, plan[0], rubric)
            log.log(0, state.eval_before)
            for warning in signal.observe_eval_before(state.eval_before):
                log.warn(warning)
        for step in range(state.step + 1, total + 1):
            stage = stage_of[step - 1]
            if step > 1 and stage is not stage_of[step - 2] and cfg.curriculum.niah.enabled:
                log.log(step - 1, niah_check(cfg, learner, stage))  # validation between stages
            groups, metrics = state.in_flight, dict(state.in_flight_metrics)
            if groups is None:
                groups, metrics = collect(cfg, pool, stage, step, rubric)
            metrics.update(rl_step(cfg, learner, pool, groups, step, run_dir))
            for warning in signal.observe(step, metrics):
                log.warn(warning)
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < total:
                metrics.update(evaluate(pool, cfg.env, cfg.rollout, stage, rubric))
            nxt, nxt_metrics = (
                collect(cfg, pool, stage_of[step], step + 1, rubric) if step < total else (None, {})
            )
            state = dataclasses.replace(state, step=step, in_flight=nxt, in_flight_metrics=nxt_metrics,
                                        extra={**state.extra, "signal": signal.state_dict()})  # fmt: skip
            steps_run += 1
            stop = cfg.run.stop_after_steps is not None and steps_run >= cfg.run.stop_after_steps
            if step == total or stop or (cfg.run.save_every and step % cfg.run.save_every == 0):
                checkpoint.save(run_dir, state, lambda p: call(learner, "save", p), cfg.run.keep_checkpoints)
            metrics["learner/workers_restarted"] = float(pool.restarts)
            log.log(step, metrics)
            log.advance(metrics)
            if stop and step < total:
                print(f"\nstopped after {steps_run} steps (run.stop_after_steps); the same command resumes")
                return 0
        final = evaluate(pool, cfg.env, cfg.rollout, plan[-1], rubric)
        log.log(total, final)
        if cfg.curriculum.niah.enabled:
            log.log(total, niah_check(cfg, learner, plan[-1]))
        summary = finish(cfg, run_dir, state.eval_before, final, [*warm_start_warnings(run_dir), *signal.warnings])
        print(summary_text(summary), flush=True)
        return 0
    finally:
        log.close()
        pool.shutdown()
        ray.kill(learner)


def collect(cfg: TrainConfig, pool, stage, step: int, rubric=None):
    c = collect_step(pool, cfg.env, cfg.rollout, cfg.algorithm, stage, cfg.seed, step, rubric)
    return c.groups, c.metrics


def rl_step(cfg: TrainConfig, learner, pool, groups, step: int, run_dir: Path) -> dict:
    """Advantages -> train step -> weight sync; nothing when every group was dropped."""
    if not groups:
        return {}
    batches = train_minibatches(groups, cfg.algorithm, cfg.learner.micro_batch_tokens, seed=step,
                                values_fn=lambda b: call(learner, "turn_values", b))  # fmt: skip
    metrics = call(learner, "train_step", batches)
    update = call(learner, "export_weights", str(run_dir / "weights"))
    pool.update_weights(update.path, update.version, update.adapter_only)
    return metrics


def uses_group_stats(a) -> bool:
    """The objective's baseline or scale comes from the group (zero-variance groups teach nothing)."""
    return a.baseline in ("group_mean", "leave_one_out") or a.std_norm == "group"


def finish(cfg: TrainConfig, run_dir: Path, before: dict, after: dict, warnings=()) -> dict:
    """summary.json; ``warnings`` (no learning signal, rl/signal.py) are listed in it, [] when none."""
    b, a = before.get("eval/success_rate", 0.0), after.get("eval/success_rate", 0.0)
    summary = {
        "run_dir": str(run_dir),
        "algorithm": cfg.algorithm.name,
        "eval_env": cfg.env.eval_env,
        "eval_tasks": cfg.env.num_eval_tasks,
        "held_out_success_before": b,
        "held_out_success_after": a,
        "held_out_success_gain_points": 100.0 * (a - b),
        "eval_reward_before": before.get("eval/mean", 0.0),
        "eval_reward_after": after.get("eval/mean", 0.0),
        "warnings": list(warnings),
    }
    if cfg.run.plots:
        summary["plots"] = ", ".join(Path(p).name for p in write_plots(run_dir))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(main())
