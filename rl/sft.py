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
import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any

from envs.types import Episode, EpisodeStatus, Turn
from rl.batching import episode_row, pack
from rl.config import SFTConfig, TrainConfig, load_config


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
    learner: Any, episodes: list[Episode], cfg: SFTConfig, micro_batch_tokens: int, log=print
) -> dict:
    """Train ``learner`` (a Learner or its actor handle) for ``cfg.epochs`` epochs; last metrics out."""
    metrics: dict[str, float] = {}
    step, t0 = 0, time.time()
    for epoch in range(cfg.epochs):
        for batch in sft_batches(episodes, cfg.batch_episodes, micro_batch_tokens, cfg.seed + epoch):
            if cfg.max_steps is not None and step >= cfg.max_steps:
                break
            metrics = call(learner, "sft_step", batch)
            step += 1
            if step % 10 == 0:
                log(f"sft epoch {epoch} step {step}: nll {metrics['sft/nll']:.3f} ({time.time() - t0:.0f}s)")
    return {**metrics, "sft/steps": float(step), "sft/seconds": time.time() - t0}


def sft_learner_config(cfg: TrainConfig):
    """The learner settings of the warm start: the RL learner's, with the SFT learning rate."""
    return dataclasses.replace(
        cfg.learner, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps, balancer="update"
    )


def main(argv: list[str] | None = None) -> int:
    from rl.learner import Learner

    p = argparse.ArgumentParser(prog="python -m rl.sft", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    out_dir = cfg.sft.output_dir or str(Path(cfg.run.dir) / "sft")
    episodes = expert_episodes(cfg.sft, cfg.env.kwargs)
    learner = Learner(cfg.model, sft_learner_config(cfg), cfg.algorithm)
    metrics = run_sft(learner, episodes, cfg.sft, cfg.learner.micro_batch_tokens)
    learner.save_pretrained(out_dir)
    print(f"sft done: {metrics}; checkpoint -> {out_dir} (use model.init_from={out_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
