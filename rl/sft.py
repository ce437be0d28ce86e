"""Warm start: supervised fine-tuning on the environments' scripted-expert trajectories.

``python -m rl.sft --config PATH [key=value ...]`` trains on ``sft.num_episodes`` expert episodes
and writes an HF checkpoint (``sft.output_dir``, default ``<run.dir>/sft``) that an RL run loads with
``model.init_from``. ``rl.train`` runs the same warm start itself when ``sft.enabled`` is true.

Expert episodes are laid out exactly like rollout episodes: the opening messages rendered with the
rollout renderer plus the generation prompt, then per turn the expert's assistant text as "sampled"
ids (ending with the stop token the engine would stop on: ``</tool_call>`` or ``<|im_end|>``) and the
renderer's continuation (closing tokens, observation messages, next generation prompt) as the next
turn's prompt. The loss is next-token cross-entropy on the assistant tokens only, averaged over all
assistant tokens of a batch (token_mean).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.types import Episode, EpisodeStatus, Turn
from rl.batching import episode_row, pack
from rl.config import ConfigError, SFTConfig, TrainConfig, load_config


def call(obj: Any, method: str, *args: Any) -> Any:
    """Call a method on a plain object or on a Ray actor handle (then wait for the result)."""
    fn = getattr(obj, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args))
    return fn(*args)


def expert_episode(env, renderer, options: dict[str, Any], env_id: str, max_turns: int = 16) -> Episode:
    """One scripted-expert episode in token space (logprobs 0: the expert is deterministic)."""
    obs, info = env.reset(options=options)
    ep = Episode(episode_id=f"expert/{info['task_id']}", task_id=info["task_id"], env_id=env_id,
                 messages=list(obs["messages"]), tools=list(obs["tools"]), info=dict(info))  # fmt: skip
    ep.info["task_key"] = env.task.key  # content, so validation tasks can avoid every training task
    prompt = renderer.render(obs["messages"], obs["tools"], add_generation_prompt=True)
    for _ in range(max_turns):
        action = env.expert_action()
        sampled = renderer.message_body({"role": "assistant", "content": action})
        if not sampled or sampled[-1] != renderer.tool_call_end_id:
            sampled = [*sampled, renderer.im_end_id]
        obs, reward, terminated, truncated, info = env.step(action)
        ep.turns.append(Turn(prompt_token_ids=prompt, token_ids=sampled, logprobs=[0.0] * len(sampled),
                             text=action, observation=list(obs["messages"]), reward=float(reward), info=info))  # fmt: skip
        if terminated or truncated:
            ep.status = EpisodeStatus.COMPLETED if terminated else EpisodeStatus.TRUNCATED
            ep.reward = float(reward)
            ep.info.update(info)
            return ep
        prompt = renderer.continuation_ids(sampled, obs["messages"])
    ep.status, ep.status_detail = EpisodeStatus.TRUNCATED, "max_turns"
    return ep


def expert_episodes(cfg: SFTConfig, env_kwargs: dict[str, dict], renderer=None) -> list[Episode]:
    """``cfg.num_episodes`` solved expert episodes from the training split, drawn by ``cfg.env_mix``."""
    import envs

    if renderer is None:
        from rollout.renderer import ChatRenderer

        renderer = ChatRenderer()
    rng = random.Random(cfg.seed)
    names, weights = zip(*cfg.env_mix.items())
    made = {n: envs.make(n, **env_kwargs.get(n, {})) for n in names}
    out: list[Episode] = []
    for i in range(cfg.num_episodes):
        name = rng.choices(names, weights)[0]
        ep = expert_episode(
            made[name], renderer, {"split": "train", "task_index": cfg.seed * 1_000_003 + i}, name
        )
        if not ep.info.get("solved", False):
            raise RuntimeError(f"the scripted expert of {name} failed task {ep.task_id}: {ep.status_detail}")
        out.append(ep)
    return out


def check_tasks(cfg: SFTConfig, env_kwargs: dict[str, dict], exclude_keys: set[str]) -> list:
    """``cfg.num_check_tasks`` train-split tasks drawn by ``cfg.env_mix`` whose content is none of
    ``exclude_keys`` (the warm start's own tasks): the check measures the skill, not memory. The test
    split stays untouched for the held-out evaluation."""
    import envs
    from rollout.manager import TaskSpec

    rng = random.Random(cfg.seed + 7_777_777)
    names, weights = zip(*cfg.env_mix.items())
    made = {n: envs.make(n, **env_kwargs.get(n, {})) for n in names}
    out, index = [], cfg.seed * 1_000_003 + 500_000_000
    while len(out) < cfg.num_check_tasks:
        name = rng.choices(names, weights)[0]
        index += 1
        env = made[name]
        if env.task_for("train", env.difficulty, index).key in exclude_keys:
            continue
        out.append(TaskSpec(env=name, options={"split": "train", "task_index": index},
                            env_kwargs=dict(env_kwargs.get(name, {}))))  # fmt: skip
    return out


class SFTCheck:
    """The warm start's greedy success on validation tasks, measured by rollout engines.

    ``pool`` holds the workers (``pool.workers``: ``RolloutWorker`` objects or their actor handles); each
    call exports the learner's weights to ``weights_dir``, loads them into every worker in place and runs
    one greedy episode per task through ``rl.rollouts.make_manager``, as RL evaluation does."""

    def __init__(self, pool: Any, tasks: list, rollout_cfg, stage, weights_dir: str) -> None:
        self.pool, self.tasks, self.weights_dir = pool, tasks, weights_dir
        self.rollout_cfg, self.stage = rollout_cfg, stage

    def __call__(self, learner: Any) -> float:
        from rl.rollouts import episode_metrics, make_manager

        update = learner.export_weights(self.weights_dir)
        for w in self.pool.workers:
            call(w, "update_weights", update.path, update.version)
        manager = make_manager(self.pool, self.rollout_cfg, self.stage, 0.0, id_prefix="sftcheck-")
        groups = manager.collect(self.tasks, 1, seed=0)
        return episode_metrics(groups, prefix="check")["check/success_rate"]


def sft_batches(episodes: list[Episode], batch_episodes: int, micro_batch_tokens: int, seed: int):
    """Shuffled optimizer batches of packed micro-batches (loss on assistant tokens, token_mean)."""
    rows = [episode_row(ep, [0.0] * len(ep.turns)) for ep in episodes]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    for s in range(0, len(order), batch_episodes):
        yield pack([rows[i] for i in order[s : s + batch_episodes]], "token_mean", 1).split(
            micro_batch_tokens
        )


def run_sft(
    learner: Any, episodes: list[Episode], cfg: SFTConfig, micro_batch_tokens: int, log=print,
    check: Callable[[Any], float] | None = None,
) -> dict:  # fmt: skip
    """Train ``learner`` (a Learner or a ``LearnerGroup``) for ``cfg.epochs`` epochs or ``cfg.max_steps``
    steps; with ``cfg.target_success`` and a ``check`` (learner -> success in [0, 1]), stop at the first
    check that reaches the target. Last metrics out, with the checks' history."""
    metrics: dict[str, float] = {}
    step, t0, history = 0, time.time(), []
    checking = check is not None and cfg.target_success is not None
    reached = False
    for epoch in range(cfg.epochs):
        for batch in sft_batches(episodes, cfg.batch_episodes, micro_batch_tokens, cfg.seed + epoch):
            if reached or (cfg.max_steps is not None and step >= cfg.max_steps):
                break
            metrics = learner.sft_step(batch)
            step += 1
            if step % 50 == 0:
                log(f"sft epoch {epoch} step {step}: nll {metrics['sft/nll']:.3f} ({time.time() - t0:.0f}s)")
            if checking and step % cfg.check_every == 0:
                history.append((step, check(learner)))
                reached = history[-1][1] >= cfg.target_success
                log(f"sft step {step}: validation success {history[-1][1]:.1%} (target {cfg.target_success:.0%})")
    out = {**metrics, "sft/steps": float(step), "sft/seconds": time.time() - t0}
    if checking:
        out.update({"sft/check_success": history[-1][1] if history else 0.0, "sft/target_reached": float(reached),
                    "sft/check_history": [list(h) for h in history]})  # fmt: skip
        if not reached:
            log(f"WARNING: the warm start stopped after {step} steps below its target success "
                f"{cfg.target_success:.0%} (last check {out['sft/check_success']:.1%}); raise sft.max_steps "
                "or sft.num_episodes, or lower sft.target_success")  # fmt: skip
    return out


def warm_start(cfg: TrainConfig, run_dir: Path, start_learner: Callable) -> str | None:
    """The checkpoint RL starts from: ``model.init_from``, or the warm start's (trained here in the learner
    group ``start_learner(cfg, model_cfg, learner_cfg)`` returns, or found from an earlier run), or None."""
    if cfg.model.init_from or not cfg.sft.enabled:
        return cfg.model.init_from
    out = Path(cfg.sft.output_dir or run_dir / "sft")
    if (out / "config.json").is_file():
        return str(out)
    from rl.rollouts import make_renderer

    learner = start_learner(cfg, cfg.model, sft_learner_config(cfg))
    episodes = expert_episodes(cfg.sft, sft_env_kwargs(cfg), make_renderer(cfg.model))
    with _checker(cfg, run_dir, learner, episodes) as check:
        metrics = run_sft(learner, episodes, cfg.sft, cfg.learner.micro_batch_tokens, check=check)
    tmp = out.with_name(out.name + ".tmp")  # complete or absent: config.json marks a finished warm start
    shutil.rmtree(tmp, ignore_errors=True)
    learner.save_pretrained(str(tmp))
    learner.shutdown()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (run_dir / "sft_metrics.json").write_text(json.dumps(metrics, indent=1))
    shown = {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}
    print(f"warm start done: {shown}", flush=True)
    return str(out)


def warm_start_warnings(run_dir: Path) -> list[str]:
    """The warm start's own warning for the run summary: it stopped below its target success."""
    path = Path(run_dir) / "sft_metrics.json"
    m = json.loads(path.read_text()) if path.is_file() else {}
    if m.get("sft/target_reached", 1.0):
        return []
    return [f"the warm start stopped after {m.get('sft/steps', 0):.0f} steps at {m.get('sft/check_success', 0):.1%} "
            "validation success, below sft.target_success: raise sft.max_steps or sft.num_episodes, or lower "
            "the target"]  # fmt: skip


@contextlib.contextmanager
def _checker(cfg: TrainConfig, run_dir: Path, learner: Any, episodes: list[Episode]):
    """An ``SFTCheck`` on a rollout worker pool of its own (closed afterwards), or None without a target."""
    if cfg.sft.target_success is None:
        yield None
        return
    from rl.config import stages
    from rl.rollouts import WorkerPool, make_renderer, prepare_model_dir

    plan, weights, renderer = stages(cfg), str(run_dir / "weights_sft"), make_renderer(cfg.model)
    first = learner.export_weights(weights)
    pool = WorkerPool(cfg.rollout, prepare_model_dir(first.path, renderer), first.version,
                      max(s.max_context_tokens for s in plan), renderer=renderer)  # fmt: skip
    try:
        tasks = check_tasks(cfg.sft, sft_env_kwargs(cfg), {e.info["task_key"] for e in episodes})
        yield SFTCheck(pool, tasks, cfg.rollout, plan[0], weights)
    finally:
        pool.shutdown()
        shutil.rmtree(weights, ignore_errors=True)


def sft_env_kwargs(cfg: TrainConfig) -> dict[str, dict]:
    """Env kwargs of the warm start: ``env.kwargs`` with ``sft.env_kwargs`` merged over it per env."""
    names = set(cfg.env.kwargs) | set(cfg.sft.env_kwargs)
    return {n: {**cfg.env.kwargs.get(n, {}), **cfg.sft.env_kwargs.get(n, {})} for n in names}


def sft_learner_config(cfg: TrainConfig):
    """The learner settings of the warm start: the RL learner's, with the SFT learning rate."""
    return dataclasses.replace(
        cfg.learner, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps, balancer="update"
    )


def main(argv: list[str] | None = None) -> int:
    from rl.learner import Learner
    from rl.preflight import preflight

    p = argparse.ArgumentParser(prog="python -m rl.sft", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        preflight(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.sft.target_success is not None:
        print("note: python -m rl.sft starts no rollout engine, so sft.target_success is not checked here; "
              "it trains for sft.max_steps / all epochs (rl.train checks the target)")  # fmt: skip
    from rl.rollouts import make_renderer

    out_dir = cfg.sft.output_dir or str(Path(cfg.run.dir) / "sft")
    episodes = expert_episodes(cfg.sft, sft_env_kwargs(cfg), make_renderer(cfg.model))
    learner = Learner(cfg.model, sft_learner_config(cfg), cfg.algorithm)
    metrics = run_sft(learner, episodes, cfg.sft, cfg.learner.micro_batch_tokens)
    learner.save_pretrained(out_dir)
    print(f"sft done: {metrics}; checkpoint -> {out_dir} (use model.init_from={out_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
