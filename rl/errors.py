"""Env and tool failures, loud and kept: ``errors.jsonl``, the console, the exit codes.

An episode whose env failed (its constructor, ``reset`` or ``step`` raised: ``info["error_where"]``
starting with ``env.``) is an ERROR episode; rollout/episode.py keeps the exception's traceback and
location in its info (envs/tracebacks.py). A tool of a ``ToolEnv`` that raised something other than
``ToolError`` or a timeout (a bug in the tool) leaves the episode running (the model is shown the
error) and its traceback in the turn's ``info["tool_crashes"]`` (envs/base.py). The driver hands every
collected and evaluated episode to ``ErrorLog.record``, which

- appends one ``errors.jsonl`` row per failure (``Failure``: step, phase, episode id, env, task, where
  (``env.make`` / ``env.reset`` / ``env.step``, or ``tool <name>``), error, location, the line of code,
  the traceback);
- prints the first failure of each kind (exception type + location) on the console, with the user's
  file and line, once per run dir (a resumed run remembers the kinds it has shown).

``EnvFailure`` is what stops a run when most of a step's episodes failed in the env
(``rollout.max_env_error_fraction``); ``rl.train.main`` turns it into ``EXIT_ENV_FAILURE``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from envs.types import Episode, EpisodeStatus

EXIT_OK = 0
EXIT_CONFIG = 2
"""A config error, a refused resume: nothing ran (rl.train prints the reason on stderr)."""
EXIT_ENV_FAILURE = 3
"""The run stopped: most episodes of a step failed in the env (checkpoints and metrics so far kept)."""
EXIT_EVAL_FAILED = 4
"""The run finished, but an evaluation measured nothing (every held-out episode failed in the env)."""

ERRORS_FILE = "errors.jsonl"


@dataclass
class Failure:
    """One env failure of one episode: a row of ``errors.jsonl``."""

    step: int
    phase: str  # "train" (collected for this step) or "eval" (the evaluation after this step; 0: before RL)
    episode_id: str
    env: str
    task: str  # the task id; for an env that could not be built, its reset options ("split=test task_index=3")
    where: str  # env.make, env.reset or env.step
    error: str  # "Type: message"
    error_type: str
    location: str  # "file:line in function": the user's frame where there is one
    code: str  # the source line at location
    traceback: str

    @property
    def kind(self) -> tuple[str, str]:
        """Failures of one kind: the same exception type raised at the same place."""
        return self.error_type, self.location or self.where


def is_env_failure(ep: Episode) -> bool:
    return ep.status == EpisodeStatus.ERROR and str(ep.info.get("error_where", "")).startswith("env.")


def failure_of(ep: Episode, step: int, phase: str) -> Failure:
    info = ep.info
    where = str(info.get("error_where", ""))
    error = ep.status_detail.removeprefix(f"{where}: ")
    task = ep.task_id or " ".join(f"{k}={v}" for k, v in (info.get("reset_options") or {}).items())
    return Failure(step=step, phase=phase, episode_id=ep.episode_id, env=ep.env_id, task=task,
                   where=where, error=error, error_type=str(info.get("error_type", "")),
                   location=str(info.get("error_location", "")), code=str(info.get("error_code", "")),
                   traceback=str(info.get("error_traceback", "")))  # fmt: skip


def tool_crashes(ep: Episode, step: int, phase: str) -> list[Failure]:
    """The tool crashes of ``ep``'s turns (``info["tool_crashes"]``, envs/base.py)."""
    crashes = [c for t in ep.turns for c in t.info.get("tool_crashes") or []]
    return [Failure(step=step, phase=phase, episode_id=ep.episode_id, env=ep.env_id, task=ep.task_id,
                    where=f"tool {c.get('tool', '?')}", error=str(c.get("error", "")),
                    error_type=str(c.get("error_type", "")), location=str(c.get("location", "")),
                    code=str(c.get("code", "")), traceback=str(c.get("traceback", ""))) for c in crashes]  # fmt: skip


def env_failures(episodes: Iterable[Episode], step: int, phase: str) -> list[Failure]:
    """Env failures (ERROR episodes) and tool crashes of ``episodes``."""
    out = []
    for e in episodes:
        out += [failure_of(e, step, phase)] if is_env_failure(e) else []
        out += tool_crashes(e, step, phase)
    return out


def describe(f: Failure) -> str:
    """One failure for the console: what failed where, the user's line, where the rest is."""
    at = f"\n  at {f.location}" + (f": {f.code}" if f.code else "") if f.location else ""
    what = (f"{f.where} of env {f.env} raised {f.error} (the model was shown the error; the episode went on)"
            if f.where.startswith("tool ") else f"{f.where} of env {f.env} failed: {f.error}")  # fmt: skip
    return f"{what}{at}\n  (task {f.task}, episode {f.episode_id})"


class EnvFailure(RuntimeError):
    """Too many episodes of a step failed in the env: the run stops. ``episodes`` are all the step's
    episodes, so the driver can still record them."""

    def __init__(self, message: str, episodes: list[Episode]) -> None:
        super().__init__(message)
        self.episodes = episodes


def failure_message(step: int, failed: list[Episode], total: int, limit: float) -> str:
    f = failure_of(failed[0], step, "train")
    share = "every episode" if len(failed) == total else f"{len(failed)} of {total} episodes"
    at = f" at {f.location}" if f.location else ""
    return (
        f"{share} of step {step} failed in the env (more than rollout.max_env_error_fraction="
        f"{limit:g}); the first: {f.where} of env {f.env}: {f.error}{at}"
    )


class ErrorLog:
    """``<run_dir>/errors.jsonl`` and the first-of-its-kind console lines (see the module docstring)."""

    def __init__(self, run_dir: str | Path, echo: Callable[[str], None] = print) -> None:
        self.path = Path(run_dir) / ERRORS_FILE
        self.echo = echo
        self.seen: set[tuple[str, str]] = {Failure(**r).kind for r in read_errors(self.path)}

    def record(self, step: int, phase: str, episodes: Iterable[Episode]) -> list[Failure]:
        """Append the env failures among ``episodes``; print each new kind. Returns the failures."""
        failures = env_failures(episodes, step, phase)
        if not failures:
            return failures
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            for f in failures:
                out.write(json.dumps(asdict(f)) + "\n")
        for f in failures:
            if f.kind not in self.seen:
                self.seen.add(f.kind)
                self.echo(f"ERROR: {describe(f)}\n  every env failure, with its traceback: {self.path}")
        return failures


def read_errors(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


def truncate_errors(path: str | Path, last_train: int, last_eval: int) -> None:
    """A resumed run's errors.jsonl without the rows of what it redoes: collections after step
    ``last_train`` and evaluations after step ``last_eval`` (rl/rundir.py says which those are)."""
    rows = read_errors(path)
    keep = [r for r in rows if r["step"] <= (last_train if r["phase"] == "train" else last_eval)]
    if len(keep) < len(rows):
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in keep))
