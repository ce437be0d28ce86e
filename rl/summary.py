"""The run's summary.json (and the exit code it implies)."""

from __future__ import annotations

import json
from pathlib import Path

from rl.config import TrainConfig
from rl.errors import EXIT_EVAL_FAILED, EXIT_OK
from rl.metrics import write_plots


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
