"""The rules a loaded ``TrainConfig`` must satisfy beyond its types, as lists of messages.

``config_errors`` holds the cross-field rules (ranges, choices, combinations the dataclasses cannot
express); ``nested_key_errors`` checks the keys inside the dicts the schema types only loosely
(``model.arch``, ``rollout.engine``, ``env.kwargs``), which needs the model config, the worker and the
env registry: imported lazily, so that loading a config stays import-light. Each message names its key.

The checks only list problems; rl/config.py turns a non-empty list into a ``ConfigError``
(``validate``, ``check_nested_keys``) and re-exports the public names here, so this module reads the
schema's types without importing rl.config at run time (no import cycle).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from rl import algorithms
from rollout.template_check import TEMPLATE_CHECKS

if TYPE_CHECKING:
    from rl.config import (
        AlgorithmConfig,
        LearnerConfig,
        ModelConfig,
        RewardConfig,
        RolloutConfig,
        TrainConfig,
    )

RESUME_MODES = ("auto", "never", "force")
"""The values of ``run.resume`` (``RunConfig`` maps the boolean spellings onto them)."""


# --------------------------------------------------------------------------- cross-field rules


def _check(ok: bool, key: str, why: str, errors: list[str]) -> None:
    if not ok:
        errors.append(f"{key}: {why}")


def _choice(value: Any, allowed: tuple[str, ...], key: str, errors: list[str]) -> None:
    _check(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}", errors)


def config_errors(cfg: TrainConfig) -> list[str]:
    """Every cross-field rule ``cfg`` breaks, one message each (empty: none)."""
    errors: list[str] = []
    _validate_algorithm(cfg.algorithm, cfg.rollout, errors)
    _validate_learner(cfg.learner, errors)
    _validate_rollout(cfg.rollout, errors)
    _validate_curriculum(cfg, errors)
    for key, mix in [("env.mix", cfg.env.mix), ("sft.env_mix", cfg.sft.env_mix)]:
        _check(bool(mix) and all(w >= 0 for w in mix.values()) and sum(mix.values()) > 0, key,
               "needs at least one env with a positive weight and no negative weights", errors)  # fmt: skip
    _check(cfg.env.num_eval_tasks >= 1, "env.num_eval_tasks", "must be >= 1", errors)
    _validate_tokenizer(cfg.model, errors)
    _validate_reward(cfg.reward, errors)
    _check(cfg.run.no_signal_steps >= 0, "run.no_signal_steps", "must be >= 0", errors)
    _choice(cfg.run.resume, RESUME_MODES, "run.resume (true = auto, false = never)", errors)
    _check(cfg.run.transcripts_per_step >= 0, "run.transcripts_per_step", "must be >= 0", errors)
    _check(cfg.sft.epochs >= 1 and cfg.sft.num_episodes >= 1 and cfg.sft.batch_episodes >= 1, "sft",
           "epochs, num_episodes and batch_episodes must be >= 1", errors)  # fmt: skip
    t = cfg.sft.target_success
    _check(t is None or 0 < t <= 1, "sft.target_success", f"must be in (0, 1] or null, got {t}", errors)
    _check(cfg.sft.check_every >= 1 and cfg.sft.num_check_tasks >= 1, "sft.check_every/num_check_tasks",
           "must be >= 1", errors)  # fmt: skip
    return errors


def _validate_algorithm(a: AlgorithmConfig, r: RolloutConfig, errors: list[str]) -> None:
    if a.name not in algorithms.PRESETS:
        errors.append(f"algorithm.name: unknown algorithm {a.name!r}; known: {sorted(algorithms.PRESETS)}")
        return
    _choice(a.credit, algorithms.CREDITS, "algorithm.credit", errors)
    _choice(a.baseline, algorithms.BASELINES, "algorithm.baseline", errors)
    _choice(a.std_norm, algorithms.STD_NORMS, "algorithm.std_norm", errors)
    _choice(a.ratio_level, algorithms.RATIO_LEVELS, "algorithm.ratio_level", errors)
    _choice(a.loss_agg, algorithms.LOSS_AGGS, "algorithm.loss_agg", errors)
    _choice(a.kl_estimator, algorithms.KL_ESTIMATORS, "algorithm.kl_estimator", errors)
    _check(0 <= a.clip_low < 1, "algorithm.clip_low", f"must be in [0, 1), got {a.clip_low}", errors)
    _check(a.clip_high > 0, "algorithm.clip_high", f"must be > 0, got {a.clip_high}", errors)
    _check(a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip", "must be > 1 or null", errors)
    _check(a.tis_cap is None or a.tis_cap >= 1, "algorithm.tis_cap", "must be >= 1 or null", errors)
    _check(0 <= a.gamma <= 1 and 0 <= a.lam <= 1, "algorithm.gamma/lam", "must lie in [0, 1]", errors)
    _check(a.kl_coef >= 0 and a.entropy_coef >= 0, "algorithm.kl_coef/entropy_coef", "must be >= 0", errors)
    _check(a.ppo_epochs >= 1 and a.num_minibatches >= 1, "algorithm.ppo_epochs/num_minibatches",
           "must be >= 1", errors)  # fmt: skip
    uses_value = a.baseline == "value" or a.credit == "gae"
    _check(not uses_value or (a.vf_coef or 0) > 0, "algorithm.vf_coef",
           "a value baseline or credit=gae needs a value head: set vf_coef > 0", errors)  # fmt: skip
    _check(a.credit != "gae" or a.baseline == "value", "algorithm.credit",
           "credit=gae computes advantages from the value head; use baseline=value (e.g. name=ppo)", errors)  # fmt: skip
    grouped = a.baseline in ("group_mean", "leave_one_out") or a.std_norm == "group"
    _check(not grouped or r.group_size >= 2, "rollout.group_size",
           f"{a.name} uses group statistics and needs group_size >= 2, got {r.group_size}", errors)  # fmt: skip
    _check(not a.dynamic_sampling or a.baseline in ("group_mean", "leave_one_out"), "algorithm.dynamic_sampling",
           "drops zero-variance groups, so it needs a group baseline", errors)  # fmt: skip
    _check(a.norm_tokens >= 1, "algorithm.norm_tokens", "must be >= 1", errors)


def _validate_tokenizer(m: ModelConfig, errors: list[str]) -> None:
    """Shapes only; ``rl.preflight.check_tokenizer`` resolves the directory, loads and probes it."""
    _choice(m.template_check, TEMPLATE_CHECKS, "model.template_check", errors)
    _check(bool(m.tokenizer), "model.tokenizer", "must be project, checkpoint or a directory path", errors)


def _validate_reward(c: RewardConfig, errors: list[str]) -> None:
    """Shapes only; that every name resolves is checked by ``rl.train.build_reward`` (it imports them)."""
    for i, f in enumerate(c.functions):
        key = f"reward.functions[{i}]"
        _check(bool(f.fn), f"{key}.fn", "needs a reward name or 'module:attr'", errors)
        _check(math.isfinite(f.weight), f"{key}.weight", f"must be finite, got {f.weight}", errors)
    for key, value in [("reward.truncated_reward", c.truncated_reward), ("reward.error_reward", c.error_reward)]:  # fmt: skip
        _check(value is None or math.isfinite(value), key, f"must be finite, got {value}", errors)


def _validate_learner(c: LearnerConfig, errors: list[str]) -> None:
    _check(c.lr > 0, "learner.lr", "must be > 0", errors)
    _check(len(c.betas) == 2, "learner.betas", "needs two values", errors)
    _check(c.micro_batch_tokens >= 16, "learner.micro_batch_tokens", "must be >= 16", errors)
    _choice(c.device, ("auto", "cpu", "cuda"), "learner.device", errors)
    _choice(c.dtype, ("float32", "bfloat16"), "learner.dtype", errors)
    _check(not (c.dtype == "bfloat16" and c.device == "cpu"), "learner.dtype",
           "bfloat16 autocast is for GPUs; use float32 with device=cpu", errors)  # fmt: skip
    _choice(c.balancer, ("frozen", "update"), "learner.balancer", errors)
    _check(c.token_buckets is None or c.token_buckets >= 1, "learner.token_buckets", "must be >= 1 (or unset)", errors)
    _check(not c.cuda_graphs or c.compile, "learner.cuda_graphs", "replays compiled blocks: needs learner.compile=true",
           errors)  # fmt: skip
    _check(not c.cuda_graphs or c.device != "cpu", "learner.cuda_graphs", "needs a CUDA device, got device=cpu", errors)
    _check(not c.cuda_graphs or c.num_workers == 1, "learner.cuda_graphs",
           f"is for the single-process learner, got learner.num_workers={c.num_workers}", errors)  # fmt: skip
    _check(c.lora.r >= 1, "learner.lora.r", "must be >= 1", errors)
    _check(not (c.lora.target_parameters and c.lora.dropout), "learner.lora.dropout",
           f"must be 0 with target_parameters {list(c.lora.target_parameters)} (peft adapts parameters without "
           "dropout); set learner.lora.target_parameters=[] to leave the routed experts out", errors)  # fmt: skip
    _check(c.num_workers >= 1, "learner.num_workers", "must be >= 1", errors)
    _choice(c.sharding, ("auto", "fsdp", "none"), "learner.sharding", errors)
    _check(c.num_gpus is None or c.num_gpus >= 0, "learner.num_gpus", "must be >= 0", errors)
    _check(not (c.sharding == "none" and c.num_workers > 1), "learner.sharding",
           "none needs learner.num_workers=1 (several learner ranks shard with fsdp)", errors)  # fmt: skip
    _check(c.expert_parallel >= 1 and c.num_workers % c.expert_parallel == 0, "learner.expert_parallel",
           f"must be >= 1 and divide learner.num_workers ({c.num_workers}), got {c.expert_parallel}", errors)  # fmt: skip
    _check(c.expert_parallel == 1 or c.sharding != "none", "learner.expert_parallel",
           "> 1 needs the sharded learner (learner.sharding auto or fsdp)", errors)  # fmt: skip
    _check(c.expert_parallel == 1 or not (c.lora.enabled and c.lora.target_parameters), "learner.expert_parallel",
           "> 1 does not shard LoRA adapters of the routed experts; set learner.lora.target_parameters=[]", errors)  # fmt: skip
    _choice(c.weight_sync, ("directory", "object_store", "nccl", "ipc"), "learner.weight_sync", errors)
    _check(c.sync_bucket_mb > 0, "learner.sync_bucket_mb", "must be > 0", errors)
    _check(c.sync_timeout_s > 0, "learner.sync_timeout_s", "must be > 0", errors)
    _choice(c.lora.sync, ("merged", "adapter"), "learner.lora.sync", errors)
    _check(not (c.lora.enabled and c.lora.sync == "adapter" and c.balancer == "update"), "learner.lora.sync",
           "adapter sync ships only the adapters, not the balancing bias that balancer=update changes; "
           "use lora.sync=merged or balancer=frozen", errors)  # fmt: skip


def _validate_rollout(r: RolloutConfig, errors: list[str]) -> None:
    _check(r.num_workers >= 1, "rollout.num_workers", "must be >= 1", errors)
    _check(r.worker_num_gpus is None or r.worker_num_gpus >= 0, "rollout.worker_num_gpus", "must be >= 0", errors)
    _check(r.group_size >= 1 and r.tasks_per_step >= 1, "rollout", "group_size and tasks_per_step must be >= 1",
           errors)  # fmt: skip
    _check(r.temperature > 0, "rollout.temperature", "must be > 0 (sampling needs it)", errors)
    _check(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]", errors)
    _check(r.max_turns >= 1, "rollout.max_turns", "must be >= 1", errors)
    _check(0 <= r.max_env_error_fraction <= 1, "rollout.max_env_error_fraction", "must be in [0, 1]", errors)
    _check(0 < r.max_tokens_per_turn < r.max_context_tokens, "rollout.max_tokens_per_turn",
           f"must be in (0, max_context_tokens={r.max_context_tokens})", errors)  # fmt: skip


def _validate_curriculum(cfg: TrainConfig, errors: list[str]) -> None:
    for i, s in enumerate(cfg.curriculum.stages):
        key = f"curriculum.stages[{i}]"
        _check(s.steps >= 1, f"{key}.steps", "must be >= 1", errors)
        ctx = s.max_context_tokens or cfg.rollout.max_context_tokens
        per_turn = s.max_tokens_per_turn or cfg.rollout.max_tokens_per_turn
        _check(per_turn < ctx, key, f"max_tokens_per_turn={per_turn} must be below max_context_tokens={ctx}",
               errors)  # fmt: skip
        g = s.group_size or cfg.rollout.group_size
        a = cfg.algorithm
        grouped = a.baseline in ("group_mean", "leave_one_out") or a.std_norm == "group"
        _check(not grouped or g >= 2, f"{key}.group_size", f"{a.name} needs group_size >= 2", errors)
        if s.mix is not None:
            _check(bool(s.mix) and sum(s.mix.values()) > 0, f"{key}.mix", "needs a positive weight", errors)
    _check(
        cfg.curriculum.steps >= 1 or bool(cfg.curriculum.stages), "curriculum.steps", "must be >= 1", errors
    )


# --------------------------------------------------------------------------- keys inside free-form dicts

DRIVER_SET_ENGINE_KEYS = {
    "model_path": "the driver passes the exported weights",
    "policy_version": "the driver tags the weights",
    "seed": "use rollout.seed (worker i gets seed + i)",
    "max_model_len": "the driver derives it from max_context_tokens + max_tokens_per_turn",
}
"""``WorkerConfig`` fields that ``rl.rollouts.WorkerPool`` sets itself (``rollout.engine`` may not)."""
GYM_MAKE_KEYS = ("max_episode_steps", "disable_env_checker")
"""Env kwargs that ``gymnasium.make`` takes itself, whatever the env's constructor accepts."""


def _unknown_keys(key: str, given, known) -> list[str]:
    """One message per key of ``given`` not in ``known``, with the close match when there is one."""
    import difflib

    out = []
    for k in given:
        if k not in known:
            close = difflib.get_close_matches(str(k), [str(n) for n in known], n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"known: {sorted(map(str, known))}"
            out.append(f"{key}.{k}: unknown field; {hint}")
    return out


def nested_key_errors(cfg: TrainConfig) -> list[str]:
    """Every unknown key inside ``model.arch``, ``rollout.engine``, ``env.kwargs.<Env>`` and
    ``sft.env_kwargs.<Env>`` (``rl.config.check_nested_keys`` says which keys each accepts)."""
    errors = _arch_errors(cfg.model.arch, cfg.model.init_from) + _engine_errors(cfg.rollout.engine)
    for key, per_env in [("env.kwargs", cfg.env.kwargs), ("sft.env_kwargs", cfg.sft.env_kwargs)]:
        for name, kwargs in per_env.items():
            errors += _env_kwargs_errors(key, name, kwargs)
    return errors


def _arch_errors(arch: dict[str, Any], init_from: str | None) -> list[str]:
    import inspect

    from model.config import _LINEAR_ATTN_DEFAULTS, HybridConfig  # the keys the KDA layers read

    known = set(inspect.signature(HybridConfig.__init__).parameters) - {"self", "kwargs"}
    errors = _unknown_keys("model.arch", arch, known)
    lac = arch.get("linear_attn_config") or {}
    if isinstance(lac, dict):
        errors += _unknown_keys("model.arch.linear_attn_config", lac,
                                {*_LINEAR_ATTN_DEFAULTS, "kda_layers", "full_attn_layers"})  # fmt: skip
    if not errors and not init_from:  # with init_from the checkpoint's config is used, not arch
        try:  # values too (layer pattern, gate bound, choices): the learner would fail on them later
            HybridConfig(**arch)
        except (ValueError, TypeError) as e:
            errors.append(f"model.arch: {e}")
    return errors


def _engine_errors(engine: dict[str, Any]) -> list[str]:
    from rollout.worker import WorkerConfig

    fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    errors = [f"rollout.engine.{k}: set by the driver; {DRIVER_SET_ENGINE_KEYS[k]}" for k in engine
              if k in DRIVER_SET_ENGINE_KEYS]  # fmt: skip
    return errors + _unknown_keys("rollout.engine", [k for k in engine if k not in DRIVER_SET_ENGINE_KEYS],
                                  fields - set(DRIVER_SET_ENGINE_KEYS))  # fmt: skip


def _env_kwargs_errors(key: str, name: str, kwargs: dict[str, Any]) -> list[str]:
    from envs.registry import BUILTIN_ENVS

    try:
        accepted = env_kwarg_names(name)
    except (ValueError, ImportError, AttributeError) as e:
        import difflib

        close = difflib.get_close_matches(name, list(BUILTIN_ENVS), n=1)
        return [f"{key}.{name}: " + (f"unknown env; did you mean {close[0]}?" if close else str(e))]
    if accepted is None:
        return []
    return _unknown_keys(f"{key}.{name}", kwargs, {*accepted, *GYM_MAKE_KEYS})


def env_kwarg_names(name: str) -> set[str] | None:
    """The keyword arguments the env ``name`` (any name ``envs.make`` accepts) can be built with;
    None when it takes ``**kwargs`` we cannot follow.

    ``**kwargs`` of an in-tree env (the ``envs`` package) are followed up its base classes (they pass
    them on to ``ToolEnv``); a plug-in's ``**kwargs`` accept anything."""
    import inspect

    import gymnasium

    from envs.registry import load_object, register_builtins, resolve_env

    register_builtins()
    target = resolve_env(name)
    if isinstance(target, str):  # a gymnasium id: its entry point
        try:
            entry = gymnasium.spec(target).entry_point
        except gymnasium.error.Error:  # e.g. gymnasium's "module:id" form, imported only by make
            return None
        target = load_object(entry) if isinstance(entry, str) else entry
    chain = [c for c in target.__mro__ if "__init__" in c.__dict__] if inspect.isclass(target) else [target]
    names: set[str] = set()
    for fn in chain:
        if fn is object:
            break
        params = list(inspect.signature(fn.__init__ if inspect.isclass(fn) else fn).parameters.values())
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names
        if not getattr(fn, "__module__", "").startswith("envs."):
            return None
    return names
