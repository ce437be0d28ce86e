"""Run outputs: metrics as JSONL and TensorBoard, a console progress bar, PNG plots, the summary.

Metric names are ``<area>/<name>``: ``reward/*`` (``reward/env/<env>/*`` per env), ``eval/*``,
``mismatch/*``, ``loss``-family names from ``rl/losses.py`` (``kl_ref``: the KL to the reference policy,
logged when ``algorithm.kl_coef`` > 0), ``moe/*``, ``perf/*`` (seconds per phase, rl/train.py),
``rollout/*`` (``rollout/env_errors/<env>``), ``niah/*``, ``signal/*`` (rl/signal.py). One JSONL line
per step: ``{"step": n, ...}``.

Without the progress bar (``run.progress_bar=false``) every step prints one line instead: step, reward,
success, loss and the step's seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTS: dict[str, list[list[str]]] = {
    "reward.png": [["reward/mean"]],
    "success.png": [["reward/success_rate", "eval/success_rate"]],
    "kl.png": [["kl_ref"]],
    "mismatch.png": [["mismatch/kl"], ["mismatch/logprob_abs_mean"]],
}
"""File -> panels (one axis each: the keys of a panel share a scale). kl.png is the KL to the reference
policy (``kl_ref``; a run without one says so on the plot); mismatch.png is the rollout/learner gap:
the k3 KL(rollout || learner) and the mean absolute logprob difference, on separate axes (1e-8 vs 1e-4)."""
NO_DATA = {"kl_ref": "no reference policy in this run (algorithm.kl_coef = 0): no KL to plot"}


class MetricsLogger:
    """Appends metrics to ``metrics.jsonl`` (and TensorBoard), drives the progress bar."""

    def __init__(self, run_dir: str, total_steps: int, tensorboard: bool = True, progress: bool = True,
                 start_step: int = 0) -> None:  # fmt: skip
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tb"))
        self.bar = None
        self.total, self.step = total_steps, start_step
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _num(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float | int) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def advance(self, metrics: dict[str, Any]) -> None:
        """One step done: the progress bar moves, or (without it) the step's line is printed."""
        self.step += 1
        if self.bar is None:
            print(step_line(self.step, self.total, metrics), flush=True)
            return
        show = {"reward": "reward/mean", "succ": "reward/success_rate", "mism": "mismatch/logprob_abs_mean"}
        self.bar.set_postfix({k: f"{metrics[v]:.3g}" for k, v in show.items() if v in metrics})
        self.bar.update(1)

    def echo(self, text: str) -> None:
        """Lines on the console, above the progress bar (which stays intact)."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def warn(self, message: str) -> None:
        """A WARNING line on the console (above the progress bar, which stays intact)."""
        self.echo(f"WARNING: {message}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.bar = self.tb = None


def step_line(step: int, total: int, m: dict[str, Any]) -> str:
    """``step 3/40  reward 0.25  success 25%  loss 0.0123  12.4s`` (missing values left out)."""
    parts = [f"step {step}/{total}"]
    if isinstance(m.get("reward/mean"), float | int):
        parts.append(f"reward {m['reward/mean']:.3g}")
    if isinstance(m.get("reward/success_rate"), float | int):
        parts.append(f"success {100 * m['reward/success_rate']:.0f}%")
    if isinstance(m.get("loss"), float | int):
        parts.append(f"loss {m['loss']:.3g}")
    if isinstance(m.get("eval/success_rate"), float | int):
        parts.append(f"eval {100 * m['eval/success_rate']:.0f}%")
    if isinstance(m.get("perf/step_s"), float | int):
        parts.append(f"{m['perf/step_s']:.1f}s")
    return "  ".join(parts)


def _num(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def truncate_metrics(path: str | Path, last_step: int) -> None:
    """Drop rows after ``last_step`` (a resumed run rewrites the steps it redoes)."""
    rows = [r for r in read_metrics(path) if r["step"] <= last_step]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_plots(run_dir: str | Path) -> list[str]:
    """PNG plots of ``PLOTS`` over steps; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    written = []
    for name, panels in PLOTS.items():
        fig, axes = plt.subplots(len(panels), 1, figsize=(6, 3.5 * len(panels)), squeeze=False)
        for ax, keys in zip(axes[:, 0], panels):
            _panel(ax, rows, keys)
        axes[0, 0].set_title(name[:-4])
        fig.tight_layout()
        out = Path(run_dir) / name
        fig.savefig(out, dpi=80)
        plt.close(fig)
        written.append(str(out))
    return written


def _panel(ax, rows: list[dict[str, Any]], keys: list[str]) -> None:
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float | int)]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        note = next((NO_DATA[k] for k in keys if k in NO_DATA), f"no {', '.join(keys)} logged")
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, fontsize=8, wrap=True)


def summary_text(summary: dict[str, Any]) -> str:
    """The final summary block printed at the end of a run; None (a failed measurement) is FAILED."""
    lines = ["", "=" * 60, "longhorizon run summary", "=" * 60]
    for k, v in summary.items():
        if isinstance(v, list | dict):  # e.g. warnings: one per line, each readable in full
            lines.append(f"{k:<38} {len(v) or 'none'}")
            lines += [f"  - {item}" for item in v] if isinstance(v, list) else [f"  - {a}: {b}" for a, b in v.items()]
        elif v is None:
            lines.append(f"{k:<38} FAILED")
        else:
            lines.append(f"{k:<38} {v:.4g}" if isinstance(v, float) else f"{k:<38} {v}")
    lines.append("=" * 60)
    return "\n".join(lines)
