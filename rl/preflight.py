"""What the driver checks and says before it starts anything (Ray, actors, the warm start).

``rl.train`` calls these right after loading the config, so that a mistake it can see from here costs
seconds and one line, not an actor's traceback a minute later:

``preflight(cfg)`` runs every check below (``rl.train`` and ``rl.sft`` call it):

- ``check_envs``: every env id the run names resolves (registry, "module:Class", entry point).
- ``add_runtime_env_paths``: the config's ``ray.runtime_env`` (``working_dir``, ``py_modules``,
  ``env_vars.PYTHONPATH``) makes modules importable in the job's actors; the driver resolves envs and
  reward functions itself first, so the same entries go on its own ``sys.path`` before it does (and a
  runtime env that Ray would refuse to merge with a submitted job's is refused now, not at ``ray.init``).
  docs/plugins.md lists the ways a user's modules reach a job.
- ``check_checkpoints``: ``model.init_from`` (and a warm-start directory that would be loaded or
  replaced) is a readable checkpoint directory of our model.
- ``check_tokenizer``: ``model.tokenizer`` (checkpoint or a directory) holds a tokenizer whose chat
  template renders tools, tool calls and tool results token-in-token-out (rollout/template_renderer.py),
  and the model's vocab_size covers it.
- ``plan_lines``: the resolved data mixes, curriculum stages, reward and warm start, printed at start,
  so that what the run trains on is on the console before it trains on it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl.config import ConfigError, TrainConfig, check_nested_keys, stages

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
"""Weight files of a Hugging Face checkpoint directory (``save_pretrained`` writes model.safetensors)."""


def preflight(cfg: TrainConfig) -> None:
    """Every check that needs no actor, in the order a user's mistake is most likely found; ConfigError."""
    add_runtime_env_paths(cfg.ray.runtime_env)  # the actors import plug-ins from there: so do the checks
    check_envs(cfg)
    check_nested_keys(cfg)  # model.arch, rollout.engine, env.kwargs.<Env>: typos there fail here, by name
    check_checkpoints(cfg)  # model.init_from is a checkpoint: seconds and one line, not an actor's traceback
    check_tokenizer(cfg)  # model.tokenizer loads, its template passes the renderer's probes, fits the vocab


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


# --------------------------------------------------------------------------- plug-ins on the driver's path


def runtime_env_paths(runtime_env: Mapping[str, Any], cwd: Path | None = None) -> list[str]:
    """The local paths ``runtime_env`` makes importable in the job's workers, in the order Ray puts them
    first on their path: ``working_dir``, each ``py_modules`` entry (a directory or a ``.py`` file: its
    parent directory, as Ray extracts it into a directory of its own; a ``.whl``/``.zip``: the file,
    which zipimport reads), then the entries of ``env_vars.PYTHONPATH`` (``${VAR}`` expanded, as Ray does).

    Remote URIs (``s3://``, ``https://``, ...) are left out: the driver cannot import from them. A local
    path that does not exist is a ConfigError (Ray would refuse it at ``ray.init``, after the checks)."""
    cwd = cwd or Path.cwd()
    out: list[str] = []
    working_dir = runtime_env.get("working_dir")
    if isinstance(working_dir, str) and not _is_uri(working_dir):
        p = _local(working_dir, cwd, "ray.runtime_env.working_dir")
        if p.is_dir():
            out.append(str(p))
    for i, entry in enumerate(runtime_env.get("py_modules") or []):
        if isinstance(entry, str) and not _is_uri(entry):
            p = _local(entry, cwd, f"ray.runtime_env.py_modules[{i}]")
            out.append(str(p if p.suffix in (".whl", ".zip") else p.parent))
    pythonpath = (runtime_env.get("env_vars") or {}).get("PYTHONPATH")
    if isinstance(pythonpath, str):
        out += [str(Path(cwd, p)) for p in os.path.expandvars(pythonpath).split(os.pathsep) if p]
    return list(dict.fromkeys(out))


def add_runtime_env_paths(runtime_env: Mapping[str, Any], cwd: Path | None = None) -> list[str]:
    """Put ``runtime_env_paths`` at the front of the driver's ``sys.path``; returns the paths added.
    Under ``ray job submit`` it first refuses what Ray would refuse later (``check_job_runtime_env``)."""
    check_job_runtime_env(runtime_env)
    new = [p for p in runtime_env_paths(runtime_env, cwd) if p not in sys.path]
    sys.path[:0] = new
    if new:
        importlib.invalidate_caches()  # entry points (dist-info) and modules under the new paths
    return new


JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray in the driver of a submitted job: the job's config as JSON, its runtime env included."""


def check_job_runtime_env(runtime_env: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """Ray merges the runtime env of a submitted job (``ray job submit --runtime-env-json`` /
    ``--working-dir``) with the driver's (``ray.runtime_env``), and at ``ray.init``, after every other
    check, refuses a field or an environment variable that both set (unless
    RAY_OVERRIDE_JOB_RUNTIME_ENV=1, which lets the driver's win): a one-line ConfigError here instead."""
    environ = os.environ if environ is None else environ
    raw = environ.get(JOB_CONFIG_VAR)
    if not runtime_env or not raw or environ.get("RAY_OVERRIDE_JOB_RUNTIME_ENV") == "1":
        return
    try:
        job = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return
    both = sorted((set(job) & set(runtime_env)) - {"env_vars"})
    both += [
        f"env_vars.{k}"
        for k in sorted(set(job.get("env_vars") or {}) & set(runtime_env.get("env_vars") or {}))
    ]
    if both:
        raise ConfigError(f"ray.runtime_env sets {', '.join(both)}, which the submitted job's runtime env sets too "
                          "(ray job submit --runtime-env-json / --working-dir); Ray refuses to merge the two: "
                          "set each in one place")  # fmt: skip


def _is_uri(path: str) -> bool:
    return "://" in path


def _local(path: str, cwd: Path, key: str) -> Path:
    p = (cwd / os.path.expanduser(path)).resolve()
    if not p.exists():
        raise ConfigError(f"{key}={path!r}: no such file or directory (relative paths are from {cwd})")
    return p


# --------------------------------------------------------------------------- checkpoints


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be loaded as a checkpoint of our model (None: it can, as far as a look at its
    files tells): it must be a directory with a readable config.json of our model type and weights."""
    from model.config import HybridConfig

    p = Path(path)
    if not p.exists():
        return "no such directory"
    if not p.is_dir():
        return "not a directory (a checkpoint is a directory with config.json and weights)"
    if not (p / "config.json").is_file():
        return "no config.json: not a checkpoint directory (rl.sft and the warm start write them)"
    try:
        meta = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"config.json is unreadable: {e}"
    model_type = meta.get("model_type") if isinstance(meta, dict) else None
    if model_type != HybridConfig.model_type:
        return f"config.json has model_type {model_type!r}, not {HybridConfig.model_type!r} (our model)"
    if not any(next(p.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return f"no weights ({' or '.join(WEIGHT_PATTERNS)}) beside config.json"
    return None


def warm_start_dir(cfg: TrainConfig) -> Path:
    """Where the warm start is written, and found by a later run (``rl.sft.warm_start``)."""
    return Path(cfg.sft.output_dir or Path(cfg.run.dir) / "sft")


def check_checkpoints(cfg: TrainConfig) -> None:
    """``model.init_from`` must be a checkpoint; with a warm start to run, its directory must be one (it
    is then loaded as the finished warm start), absent, or empty, since the warm start replaces it
    (a non-empty ``sft.output_dir`` of other files would be deleted). One-line ConfigError otherwise."""
    if cfg.model.init_from:
        why = checkpoint_problem(cfg.model.init_from)
        if why:
            raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {why}")
        return
    out = warm_start_dir(cfg)
    if not cfg.sft.enabled or not out.exists():
        return
    key = "sft.output_dir" if cfg.sft.output_dir else "the warm start's directory (run.dir/sft)"
    if (out / "config.json").is_file():
        why = checkpoint_problem(out)
        if why:
            raise ConfigError(f"{key} {str(out)!r} would be loaded as the finished warm start: {why}")
    elif cfg.sft.output_dir and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"sft.output_dir={cfg.sft.output_dir!r} exists and is not a checkpoint; the warm "
                          "start would replace it: name a new or empty directory")  # fmt: skip


def check_tokenizer(cfg: TrainConfig) -> None:
    """A tokenizer other than the project's loads, passes ``TemplateRenderer``'s start-up probes (a
    template without tools, tool calls or tool results, or one that breaks token-in-token-out, is named)
    and has no id past the model's vocab_size. One-line ConfigError otherwise."""
    path = cfg.model.tokenizer_dir()
    if path is None:
        return
    from rollout.template_renderer import TemplateError, load_renderer

    key = f"model.tokenizer={cfg.model.tokenizer}" + (f" ({path})" if path != cfg.model.tokenizer else "")
    try:
        size = len(load_renderer(path, cfg.model.template_check).tokenizer)
    except TemplateError as e:
        raise ConfigError(f"{key}: {e}") from None
    vocab = model_vocab_size(cfg)
    if size > vocab:
        raise ConfigError(f"{key}: the tokenizer has {size} ids but the model's vocab_size is {vocab}: ids from "
                          f"{vocab} on would index past its embedding")  # fmt: skip


def model_vocab_size(cfg: TrainConfig) -> int:
    """The vocab_size of the model the run starts from (``model.init_from``'s config.json, else the arch)."""
    if cfg.model.init_from:
        return int(json.loads(Path(cfg.model.init_from, "config.json").read_text())["vocab_size"])
    from model.config import HybridConfig

    return HybridConfig(**cfg.model.arch).vocab_size


# --------------------------------------------------------------------------- the plan, printed at start


def mix_text(mix: Mapping[str, float]) -> str:
    """``Calculator 1 (67%), NeedleHaystack 0.5 (33%)``: weights as configured, and the share sampled."""
    total = sum(mix.values()) or 1.0
    if len(mix) == 1:
        return f"{next(iter(mix))} {next(iter(mix.values())):g}"
    return ", ".join(f"{name} {w:g} ({w / total:.0%})" for name, w in mix.items())


def plan_lines(cfg: TrainConfig) -> list[str]:
    """A few lines saying what the run will train on, from the resolved config."""
    plan = stages(cfg)
    total = sum(s.steps for s in plan)
    lines = [f"plan: {cfg.algorithm.name}, {total} steps in {len(plan)} stage(s), run dir {cfg.run.dir}; "
             f"held-out eval on {cfg.env.eval_env} ({cfg.env.num_eval_tasks} tasks)"]  # fmt: skip
    lines.append(f"  env mix: {mix_text(cfg.env.mix)}")
    if cfg.env.kwargs:
        lines.append(f"  env kwargs: {_kwargs_text(cfg.env.kwargs)}")
    first = 1
    for s in plan:
        last = first + s.steps - 1
        span = f"step {first}" if last == first else f"steps {first}-{last}"
        lines.append(f"  stage {s.name} ({span}): mix {mix_text(s.mix)}; {s.tasks_per_step} tasks x "
                     f"{s.group_size} episodes, context {s.max_context_tokens} tokens")  # fmt: skip
        first = last + 1
    fns = cfg.reward.functions
    reward = ", ".join(f"{f.name or f.fn} x{f.weight:g}" for f in fns) if fns else "the env's own"
    lines.append(f"  reward: {reward}")
    lines += _start_lines(cfg, plan)
    if tokenizer := cfg.model.tokenizer_dir():
        lines.append(f"  tokenizer and chat template: {tokenizer} ({cfg.model.tokenizer})")
    return lines


def _kwargs_text(per_env: Mapping[str, Mapping[str, Any]]) -> str:
    return "; ".join(
        f"{name} " + ", ".join(f"{k}={v}" for k, v in kw.items()) for name, kw in per_env.items()
    )


def _start_lines(cfg: TrainConfig, plan) -> list[str]:
    """Where the policy starts: a checkpoint, a warm start (to train or found), or a random init."""
    if cfg.model.init_from:
        return [f"  start: model.init_from={cfg.model.init_from} (no warm start)"]
    if not cfg.sft.enabled:
        return ["  start: random init (no model.init_from, sft.enabled=false)"]
    out = warm_start_dir(cfg)
    if (out / "config.json").is_file():
        return [f"  start: the warm start already in {out} (delete it to train it again)"]
    s = cfg.sft
    if s.target_success is not None:
        stop = (f"until greedy success on {s.num_check_tasks} check tasks reaches {s.target_success:.0%} "
                f"(checked every {s.check_every} steps, at most {s.max_steps or 'all'} steps)")  # fmt: skip
    else:
        stop = f"for {s.max_steps} steps" if s.max_steps else f"for {s.epochs} epoch(s)"
    from rl.sft import sft_env_kwargs

    kwargs = {n: kw for n, kw in sft_env_kwargs(cfg).items() if n in s.env_mix and kw}
    with_kwargs = f" ({_kwargs_text(kwargs)})" if kwargs else ""
    lines = [f"  warm start: {s.num_episodes} expert episodes from {mix_text(s.env_mix)}{with_kwargs}, "
             f"{stop} -> {out}"]  # fmt: skip
    rl_envs = {n for st in plan for n, w in st.mix.items() if w > 0}
    sft_envs = {n for n, w in s.env_mix.items() if w > 0}
    if not rl_envs & sft_envs:
        lines.append(f"  note: the warm start's envs ({', '.join(sorted(sft_envs))}) are none of those RL trains "
                     f"on ({', '.join(sorted(rl_envs))}); sft.env_mix sets them")  # fmt: skip
    return lines
