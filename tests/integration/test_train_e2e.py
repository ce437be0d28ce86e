"""The real entry point end to end: ``python -m rl.train`` (local Ray, a vLLM rollout worker, SFT warm
start, GRPO steps, checkpoints, eval, plots), then kill-and-resume against the uninterrupted run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import CONFIGS_ROOT
from rl.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

ROOT = CONFIGS_ROOT.parent
CONFIG = str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml")
TRAIN_KEYS = ("loss", "pg_loss", "grad_norm", "entropy", "mismatch/logprob_abs_mean", "mismatch/kl",
              "reward/mean", "reward/success_rate", "learner/version")  # fmt: skip


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": ""}  # always a fresh local cluster, never a stray one
    cmd = [sys.executable, "-m", "rl.train", "--config", CONFIG, f"run.dir={run_dir}", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def step_rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "learner/version" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "a"
    out = train(run, "run.save_every=1", "run.keep_checkpoints=3")
    assert "held_out_success_after" in out.stdout  # the summary is printed
    return run


def test_run_outputs(uninterrupted):
    run = uninterrupted
    rows = step_rows(run)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():  # the rollout/learner mismatch is logged every step
        assert r["mismatch/tokens"] > 0 and r["mismatch/logprob_abs_mean"] >= 0
    assert rows[1]["mismatch/logprob_abs_mean"] < 1e-3  # step 0 weights: engine and learner agree
    niah = [r for r in read_metrics(run / "metrics.jsonl") if "niah/512/nll" in r]
    assert [r["step"] for r in niah] == [2, 3]  # between the two curriculum stages, and at the end
    sft = json.loads((run / "sft_metrics.json").read_text())  # the warm start's checks ran on an engine
    assert [h[0] for h in sft["sft/check_history"]] == [1, 2] and sft["sft/target_reached"] == 0.0
    summary = json.loads((run / "summary.json").read_text())
    assert any("warm start stopped" in w for w in summary["warnings"])  # its target was never reached
    assert {"held_out_success_before", "held_out_success_after"} <= set(summary)
    for name in ("reward.png", "success.png", "kl.png", "mismatch.png", "config.yaml", "sft/config.json"):
        assert (run / name).is_file(), name
    assert list((run / "tb").iterdir())
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [f"step_00000{i}" for i in (1, 2, 3)]


def test_kill_and_resume_matches_the_uninterrupted_run(uninterrupted, tmp_path):
    """Resume from the step-2 checkpoint: step 3 must reproduce the uninterrupted run's step 3."""
    resumed = tmp_path / "b"
    shutil.copytree(uninterrupted, resumed, ignore=shutil.ignore_patterns("step_000003", "summary.json"))
    out = train(resumed, "run.save_every=1", "run.keep_checkpoints=3")
    assert "resumed from" in out.stdout
    a, b = step_rows(uninterrupted)[3], step_rows(resumed)[3]
    for key in TRAIN_KEYS:
        assert a[key] == b[key], key
    assert sorted(step_rows(resumed)) == [1, 2, 3]  # no duplicated or lost steps in metrics.jsonl
