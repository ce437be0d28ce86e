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


CONSOLE: dict[str, str] = {}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "a"
    out = train(run, "run.save_every=1", "run.keep_checkpoints=3")
    assert "held_out_success_after" in out.stdout  # the summary is printed
    CONSOLE["uninterrupted"] = out.stdout
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


def test_debugging_outputs(uninterrupted):
    """Transcripts, per-env metrics, per-phase times, one console line per step (no progress bar)."""
    run = uninterrupted
    for step in (1, 2, 3):
        lines = (run / "transcripts" / f"step_00000{step}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert len(rows) == 4 and all(r["turns"] and r["turns"][0]["prompt_text"] for r in rows)
        assert all(r["sampled_tokens"] == sum(t["sampled_tokens"] for t in r["turns"]) for r in rows)
    assert {p.name for p in (run / "transcripts").glob("eval_*.jsonl")} == {
        "eval_000000.jsonl",
        "eval_000003.jsonl",
    }
    for r in step_rows(run).values():
        assert 0 <= r["reward/env/Calculator/success_rate"] <= 1 and r["rollout/env_errors/Calculator"] == 0
        assert all(r[f"perf/{k}"] > 0 for k in ("rollout_s", "train_s", "sync_s", "step_s"))
        rollout, learner = r["perf/rollout_busy_frac"], r["perf/learner_busy_frac"]
        assert r["perf/train_s"] == pytest.approx(learner * r["perf/step_s"])
        assert 0 < learner < 1 and 0 <= rollout < 1
        assert rollout + learner + r["perf/sync_s"] / r["perf/step_s"] <= 1  # one phase at a time
    rows = step_rows(run)  # the last step's window collects nothing (the final evaluation is after it)
    assert rows[1]["perf/rollout_busy_frac"] > 0 and rows[3]["perf/rollout_busy_frac"] == 0
    assert not (run / "errors.jsonl").exists()  # nothing failed
    steps = [line.split()[1] for line in CONSOLE["uninterrupted"].splitlines() if line.startswith("step ")]
    assert steps == ["1/3", "2/3", "3/3"]


def test_rerunning_the_finished_run_prints_its_summary_and_adds_no_row(uninterrupted, capsys):
    import ray

    from rl.train import main

    files = {p.name: p.read_bytes() for p in uninterrupted.iterdir() if p.is_file()}
    assert (
        main(["--config", CONFIG, f"run.dir={uninterrupted}", "run.save_every=1", "run.keep_checkpoints=3"])
        == 0
    )
    out = capsys.readouterr().out
    assert "is a finished run (step 3)" in out and "held_out_success_after" in out
    assert {p.name: p.read_bytes() for p in uninterrupted.iterdir() if p.is_file()} == files
    assert not ray.is_initialized()


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
    evals = [r["step"] for r in read_metrics(resumed / "metrics.jsonl") if "eval/success_rate" in r]
    assert evals == [0, 3]  # one evaluation before and one after RL
    assert (resumed / "config.1.yaml").read_text().startswith("# resumed at step 2")  # the config history
