"""Run checkpoints for exact resume: ``<run>/checkpoints/step_NNNNNN/{learner.pt, state.pkl}``.

``learner.pt`` is the learner's own state (weights, optimizer, balancer biases, RNG, counters; a sharded
learner group writes it as the DCP directory ``learner.dcp/`` instead, ``LearnerGroup.state_path``);
``state.pkl`` is the driver's: the step counter (the data position: training tasks are a pure
function of seed and step), the curriculum stage, the pre-RL evaluation, and the in-flight work,
i.e. the episode groups already collected for the next step with the new weights. Resuming trains
on exactly those groups, so the next step's metrics equal an uninterrupted run's.
A checkpoint directory is written under a temporary name and renamed, so a crash mid-save never
leaves a half checkpoint that looks complete.
"""

from __future__ import annotations

import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.types import EpisodeGroup


@dataclass
class RunState:
    step: int = 0  # steps completed
    in_flight: list[EpisodeGroup] | None = None  # groups collected for step + 1
    in_flight_metrics: dict[str, float] = field(default_factory=dict)
    eval_before: dict[str, float] = field(default_factory=dict)
    init_path: str = ""  # the checkpoint RL started from (after the warm start)
    niah: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / "state.pkl").is_file()) if root.is_dir() else []
    return done[-1] if done else None


def save(run_dir: str | Path, state: RunState, save_learner, keep: int) -> Path:
    """``save_learner(path)`` writes the learner file (a local call or an actor call)."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_learner(str(tmp / "learner.pt"))
    with (tmp / "state.pkl").open("wb") as f:
        pickle.dump(state, f)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _prune(Path(run_dir) / "checkpoints", keep)
    return final


def load(path: str | Path) -> RunState:
    with (Path(path) / "state.pkl").open("rb") as f:
        return pickle.load(f)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
    for p in done[: max(0, len(done) - max(keep, 1))]:
        shutil.rmtree(p, ignore_errors=True)
