"""The driver's start-up parts: the config from the command line, the reward, Ray, the learner group.

Everything here runs before (``parse``, ``build_reward``: a mistake is a ConfigError, nothing started)
or while (``connect_ray``, ``start_learner``) the run's actors start.
"""

from __future__ import annotations

import argparse
import os

from rl.config import ConfigError, LearnerConfig, ModelConfig, RewardConfig, TrainConfig, load_config
from rl.preflight import preflight


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


def start_learner(cfg: TrainConfig, model_cfg: ModelConfig, learner_cfg: LearnerConfig):
    """The learner group (``learner.num_workers`` ranks; one plain learner actor by default)."""
    from rl.learner_group import LearnerGroup

    return LearnerGroup(model_cfg, learner_cfg, cfg.algorithm)
