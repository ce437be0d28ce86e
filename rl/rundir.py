"""A run directory across invocations: resume checks, the config history, finished runs.

``open_run(cfg, total_steps)`` runs before any actor starts and decides what this invocation does:

- **fresh start** (no checkpoint in ``run.dir``, or ``run.resume=never``): the outputs of an earlier
  attempt still there (metrics.jsonl, errors.jsonl, transcripts/, config.yaml, summary.json, ...; with
  ``never`` its checkpoints too) are moved to ``previous/<n>/``, so nothing is lost and nothing is
  appended to; ``config.yaml`` is this config. The warm start (``sft/``) stays and is reused.
- **resume** (``run.resume=auto``, a checkpoint present): the resolved config is compared with the one
  the run last ran with (the newest file of its history), ignoring ``RESUME_FREE_KEYS``. A difference
  is refused (``ConfigError``, exit 2) listing every differing key with both values. With
  ``run.resume=force`` the run resumes anyway and the change is recorded: ``config_changes.jsonl``
  gets a row (the first step trained under the new config, the file, every key's old and new value),
  and every step row of metrics.jsonl from then on carries ``run/config_version`` (the history
  number). The groups a checkpoint holds for its next step were collected under the old config and are
  trained on as they are.
- **finished** (the newest checkpoint is the last step and summary.json exists): nothing runs again.
  The driver prints the summary and exits with the code the run ended with (0, or 4 when an evaluation
  failed); re-running adds no row anywhere. To train further, raise ``curriculum.steps`` with
  ``run.resume=force``.

History: ``config.yaml`` is the config the run started with; every resume writes ``config.<n>.yaml``
(n = 1, 2, ...), each with a comment line saying at which step and in which mode it resumed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rl import checkpoint
from rl.config import ConfigError, TrainConfig, to_yaml
from rl.errors import ERRORS_FILE, ErrorLog, truncate_errors
from rl.metrics import read_metrics
from rl.transcripts import TranscriptWriter

RESUME_FREE_KEYS: dict[str, str] = {
    "run.resume": "how this invocation starts",
    "run.stop_after_steps": "counts the steps of one invocation",
    "run.verbose": "console only",
    "run.progress_bar": "console only",
    "run.tensorboard": "an output format",
    "run.plots": "an output format",
    "run.transcripts_per_step": "an output sample",
    "run.save_every": "when checkpoints are written, not what is trained",
    "run.keep_checkpoints": "how many checkpoints stay on disk",
    "run.dir": "the same directory may be named differently (relative, absolute, moved or copied)",
    "ray": "where the run executes (cluster address, CPUs, object store, runtime env)",
    "rollout.num_workers": "resources: the episodes' sampling streams differ, their distribution does not",
    "rollout.worker_num_cpus": "resources",
    "rollout.worker_num_gpus": "resources",
    "learner.sync_timeout_s": "how long a weight sync may wait, not what is trained",
    "learner.num_cpus": "resources",
    "learner.num_gpus": "resources",
    "learner.torch_threads": "resources",
}
"""Keys (or whole sections) that may change between invocations of one run without ``force``."""

CHANGES_FILE = "config_changes.jsonl"
ABSENT = "<absent>"
OUTPUTS = ("metrics.jsonl", ERRORS_FILE, CHANGES_FILE, "summary.json", "transcripts", "tb", "reward.png",
           "success.png", "kl.png", "mismatch.png")  # fmt: skip
"""What a fresh start moves out of the way (with config*.yaml; checkpoints/ too under resume=never).
The warm start (sft/, sft_metrics.json) and the weight exports stay: a fresh start reuses the former."""


@dataclass
class RunDir:
    path: Path
    resume_from: Path | None = None  # the checkpoint to resume from; None: a fresh start
    state: checkpoint.RunState | None = None  # that checkpoint's driver state
    config_version: int = 0  # the number of the history file this invocation runs under (0: config.yaml)
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # forced changes: key -> (old, new)
    finished: dict[str, Any] | None = None  # the summary of a finished run (then nothing runs)


def open_run(cfg: TrainConfig, total_steps: int) -> RunDir:
    """Decide, before any actor starts, what this invocation of ``run.dir`` does (module docstring)."""
    path = Path(cfg.run.dir)
    path.mkdir(parents=True, exist_ok=True)
    latest = checkpoint.latest(path) if cfg.run.resume != "never" else None
    if latest is None:
        moved = archive_previous(path, with_checkpoints=cfg.run.resume == "never")
        if moved:
            print(f"an earlier run's outputs in {path} moved to {moved} (this is a fresh start)", flush=True)
        (path / "config.yaml").write_text(to_yaml(cfg))
        return RunDir(path)
    state = checkpoint.load(latest)
    history = config_history(path)
    changes = config_diff(load_saved(history[-1][1]), resolved(cfg)) if history else {}
    if changes and cfg.run.resume != "force":
        raise ConfigError(refusal(path, history[-1][1], state.step, changes))
    summary_file = path / "summary.json"
    if state.step >= total_steps and summary_file.is_file() and not changes:
        return RunDir(path, latest, state, finished=json.loads(summary_file.read_text()))
    version = (history[-1][0] + 1) if history else 0
    mode = f"run.resume={cfg.run.resume}"
    name = f"config.{version}.yaml" if version else "config.yaml"
    (path / name).write_text(f"# resumed at step {state.step} ({mode})\n" + to_yaml(cfg))
    if changes:
        record_changes(path, state.step + 1, name, changes)
        print(f"resuming with a changed config ({mode}), recorded in {path / CHANGES_FILE}: "
              + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in _rows(changes)), flush=True)  # fmt: skip
    forced = version if changes or _forced_before(path) else 0
    finished = state.step >= total_steps
    # kept: the collection the checkpoint holds in flight (step + 1), the evaluations up to the step's own
    # (the final one runs after the last checkpoint, so a finished run redoes it)
    truncate_errors(path / ERRORS_FILE, state.step + (state.in_flight is not None), state.step - finished)
    if finished:  # the final evaluation runs again: its rows of the interrupted attempt go
        drop_final_rows(path / "metrics.jsonl", state.step)
    return RunDir(path, latest, state, config_version=forced, changes=changes)


# --------------------------------------------------------------------------- config history and diff


def config_history(path: Path) -> list[tuple[int, Path]]:
    """(number, file) of config.yaml (0) and config.<n>.yaml, oldest first."""
    out = [(0, path / "config.yaml")] if (path / "config.yaml").is_file() else []
    for p in path.glob("config.*.yaml"):
        n = p.name.split(".")[1]
        if n.isdigit():
            out.append((int(n), p))
    return sorted(out)


def resolved(cfg: Any) -> dict[str, Any]:
    """A config (or a section of one) as plain nested values, as its YAML file holds them."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def load_saved(path: Path) -> dict[str, Any]:
    """A saved config on today's schema: fields added since it was written take their defaults (a saved
    dict-valued field such as ``env.mix`` is taken as written, never merged with the default's keys)."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return _overlay(resolved(TrainConfig()), raw if isinstance(raw, dict) else {}, TrainConfig)


def _overlay(defaults: dict[str, Any], saved: dict[str, Any], schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    out = dict(defaults)
    for k, v in saved.items():
        hint = hints.get(k)
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint) and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _overlay(out[k], v, hint)  # a section: field by field
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]) and isinstance(v, list):
            out[k] = [_overlay(resolved(args[0]()), x, args[0]) if isinstance(x, dict) else x for x in v]
        else:
            out[k] = v
    return out


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out or {prefix: []}
    return {prefix: value}


def _free(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_FREE_KEYS)


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every leaf key whose value differs (``RESUME_FREE_KEYS`` left out); absent on one side: ``ABSENT``."""
    a, b = _flatten(old), _flatten(new)
    keys = sorted(k for k in {*a, *b} if not _free(k) and a.get(k, ABSENT) != b.get(k, ABSENT))
    return {k: (a.get(k, ABSENT), b.get(k, ABSENT)) for k in keys}


def _rows(changes: dict[str, tuple[Any, Any]]):
    return [(k, a, b) for k, (a, b) in changes.items()]


def refusal(path: Path, saved: Path, step: int, changes: dict[str, tuple[Any, Any]]) -> str:
    keys = "\n  ".join(f"{k}: {a!r} (the run) -> {b!r} (now)" for k, a, b in _rows(changes))
    return (
        f"{path} holds a run (checkpoint at step {step}) whose config ({saved.name}) differs from this one "
        f"in {len(changes)} key(s):\n  {keys}\n"
        "Resuming would continue it under other settings. Run with the run's settings to resume it, "
        "pick another run.dir for a new run, run.resume=never to start over here (the old run is moved "
        "to previous/), or run.resume=force to resume with the change recorded."
    )


def record_changes(path: Path, first_step: int, config_file: str, changes: dict[str, tuple[Any, Any]]) -> None:
    row = {"first_step": first_step, "config": config_file, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "changes": {k: {"old": a, "new": b} for k, a, b in _rows(changes)}}  # fmt: skip
    with (path / CHANGES_FILE).open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def _forced_before(path: Path) -> bool:
    return (path / CHANGES_FILE).is_file()


# --------------------------------------------------------------------------- fresh starts, finished runs


def archive_previous(path: Path, with_checkpoints: bool) -> Path | None:
    """Move an earlier attempt's outputs to ``previous/<n>/``; returns that folder (None: nothing there)."""
    names = [*OUTPUTS, *(p.name for p in path.glob("config*.yaml"))]
    if with_checkpoints:
        names.append("checkpoints")
    present = [path / n for n in names if (path / n).exists()]
    if not present:
        return None
    root = path / "previous"
    n = 1 + max((int(p.name) for p in root.glob("*") if p.name.isdigit()), default=0)
    dest = root / str(n)
    dest.mkdir(parents=True)
    for p in present:
        shutil.move(str(p), str(dest / p.name))
    return dest


def drop_final_rows(path: Path, last_step: int) -> None:
    """Rows logged at ``last_step`` after its checkpoint (evaluation, NIAH), which a re-run logs again."""
    rows = read_metrics(path)
    keep = [r for r in rows if r["step"] != last_step or "learner/version" in r]
    if len(keep) < len(rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))


# --------------------------------------------------------------------------- what each step leaves


class RunOutputs:
    """What the driver records of the episodes it collects and evaluates: env failures (errors.jsonl and
    the console, rl/errors.py) and sample transcripts (rl/transcripts.py)."""

    def __init__(self, cfg: TrainConfig, path: Path, echo=print) -> None:
        from rl.rollouts import make_renderer

        tokenizer = make_renderer(cfg.model).tokenizer if cfg.run.transcripts_per_step else None
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else None
        self.errors = ErrorLog(path, echo)
        self.transcripts = TranscriptWriter(path, cfg.run.transcripts_per_step, cfg.seed, decode)

    def record(self, step: int, phase: str, episodes) -> None:
        self.errors.record(step, phase, episodes)
        self.transcripts.write(step, phase, episodes)
