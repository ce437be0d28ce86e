"""Run outputs: metrics as JSONL and TensorBoard, a console progress bar, PNG plots, the summary.

Metric names are ``<area>/<name>``: ``reward/*``, ``eval/*``, ``mismatch/*``, ``loss``-family names
from ``rl/losses.py``, ``moe/*``, ``perf/*``, ``niah/*``, ``signal/*`` (rl/signal.py). One JSONL line
per step: ``{"step": n, ...}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTS = {
    "reward.png": ["reward/mean"],
    "success.png": ["reward/success_rate", "eval/success_rate"],
    "kl.png": ["kl_ref", "mismatch/kl"],
    "mismatch.png": ["mismatch/logprob_abs_mean"],
}


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
        if self.bar is None:
            return
        show = {"reward": "reward/mean", "succ": "reward/success_rate", "mism": "mismatch/logprob_abs_mean"}
        self.bar.set_postfix({k: f"{metrics[v]:.3g}" for k, v in show.items() if v in metrics})
        self.bar.update(1)

    def warn(self, message: str) -> None:
        """A WARNING line on the console (above the progress bar, which stays intact)."""
        line = f"WARNING: {message}"
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


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
    """PNG plots of reward, success rate, KL and logprob mismatch over steps; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    written = []
    for name, keys in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float | int)]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(name[:-4])
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(run_dir) / name
        fig.savefig(out, dpi=80)
        plt.close(fig)
        written.append(str(out))
    return written


def summary_text(summary: dict[str, Any]) -> str:
    """The final summary block printed at the end of a run."""
    lines = ["", "=" * 60, "longhorizon run summary", "=" * 60]
    for k, v in summary.items():
        if isinstance(v, list):  # e.g. warnings: one per line, each readable in full
            lines.append(f"{k:<38} {len(v) or 'none'}")
            lines += [f"  - {item}" for item in v]
        else:
            lines.append(f"{k:<38} {v:.4g}" if isinstance(v, float) else f"{k:<38} {v}")
    lines.append("=" * 60)
    return "\n".join(lines)
