"""A user's env failing in a real run (``python -m rl.train``: local Ray, a vLLM rollout worker): a
training env whose step raises on some tasks and a held-out env whose constructor raises. The run goes
on (at most half of each step's episodes fail), prints each failure kind once with the user's file and
line, keeps every failure in errors.jsonl, reports the evaluations as failed (summary.json, exit code
4), and leaves per-env metrics, per-phase times, sample transcripts and one console line per step.
Re-running the finished run prints its summary and adds nothing; a changed config is refused. One run
of two steps, no warm start."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import CONFIGS_ROOT, load_config, stages
from rl.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROOT = CONFIGS_ROOT.parent
CONFIG = str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml")
CRASHING = "crashing_envs:HalfCrashingCalculator"
OVERRIDES = [
    "sft.enabled=false",
    "curriculum.stages=[]",
    "curriculum.steps=2",
    "curriculum.niah.enabled=false",
    "seed=4",  # one crashing task of the two in each step: half the episodes fail, not most
    f'env.mix={{Calculator: 1.0, "{CRASHING}": 1.0}}',
    "env.eval_env=crashing_envs:UnbuildableCalculator",
    "run.transcripts_per_step=3",
]
RAISE_LINE = next(i for i, line in enumerate((HERE / "crashing_envs.py").read_text().splitlines(), 1)
                  if 'raise ConnectionError("tool server unreachable")' in line)  # fmt: skip


def crashing_tasks(cfg, step: int) -> int:
    from rl.rollouts import train_tasks

    tasks = train_tasks(cfg.env, stages(cfg)[0], cfg.seed, step)
    return sum(t.env == CRASHING and t.options["task_index"] % 2 == 1 for t in tasks)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = load_config(CONFIG, OVERRIDES)
    assert [crashing_tasks(cfg, s) for s in (1, 2)] == [1, 1], "pick a seed with one crashing task per step"
    run_dir = tmp_path_factory.mktemp("runs") / "loud"
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "rl.train", "--config", CONFIG, f"run.dir={run_dir}", *OVERRIDES]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return cfg, run_dir, out


def test_the_run_goes_on_and_its_exit_code_says_the_evaluation_failed(run):
    _, run_dir, out = run
    assert out.returncode == 4, out.stdout[-3000:] + out.stderr[-5000:]
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "learner/version" in r}
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["rollout/env_errors"] == 4 == r[f"rollout/env_errors/{CRASHING}"]  # one group of 4
        assert r["rollout/env_errors/Calculator"] == 0 and r["rollout/train_groups"] == 1
        for env in ("Calculator", CRASHING):
            assert f"reward/env/{env}/success_rate" in r and f"reward/env/{env}/mean" in r
        for phase in ("rollout_s", "train_s", "sync_s", "step_s"):
            assert r[f"perf/{phase}"] > 0, phase
        assert r["perf/step_s"] >= r["perf/train_s"] + r["perf/sync_s"]


def test_each_failure_kind_is_printed_once_with_the_users_line(run):
    _, _, out = run
    console = out.stdout + out.stderr
    step = [line for line in console.splitlines() if line.startswith("ERROR: env.step of env")]
    assert step == [f"ERROR: env.step of env {CRASHING} failed: ConnectionError: tool server unreachable"], console[-4000:]
    assert f"  at {HERE / 'crashing_envs.py'}:{RAISE_LINE} in step: raise ConnectionError(" in console
    make = [line for line in console.splitlines() if line.startswith("ERROR: env.make of env")]
    assert len(make) == 1 and "FileNotFoundError: test set not found" in make[0]  # before and after RL: once


def test_every_failure_is_in_errors_jsonl(run):
    cfg, run_dir, _ = run
    rows = [json.loads(line) for line in (run_dir / "errors.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert sorted(r["step"] for r in train) == [1] * 4 + [2] * 4
    assert len({r["episode_id"] for r in rows}) == len(rows)
    for r in train:
        assert r["env"] == CRASHING and r["where"] == "env.step" and r["task"].startswith("HalfCrashingCalculator/")
        assert r["location"] == f"{HERE / 'crashing_envs.py'}:{RAISE_LINE} in step"
        assert 'raise ConnectionError("tool server unreachable")' in r["traceback"]
    evals = [r for r in rows if r["phase"] == "eval"]
    n = cfg.env.num_eval_tasks
    assert sorted(r["step"] for r in evals) == [0] * n + [2] * n  # before and after RL
    assert all(r["where"] == "env.make" and r["error_type"] == "FileNotFoundError" for r in evals)


def test_the_failed_evaluations_are_reported_as_failed_not_as_zero_success(run):
    _, run_dir, out = run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "eval_failed" and summary["exit_code"] == 4
    for key in ("held_out_success_before", "held_out_success_after", "held_out_success_gain_points"):
        assert summary[key] is None, key
    assert set(summary["eval_failures"]) == {"before", "after"}
    assert "test set not found" in summary["eval_failures"]["before"]
    printed = out.stdout.split("longhorizon run summary")[1]
    assert "held_out_success_before                FAILED" in printed
    assert "WARNING: the evaluation before RL failed" in out.stdout.split("longhorizon run summary")[0]
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/failed" in r]
    assert [r["step"] for r in evals] == [0, 2] and not any("eval/success_rate" in r for r in evals)


def test_transcripts_and_one_line_per_step(run):
    _, run_dir, out = run
    for step in (1, 2):
        rows = [json.loads(line) for line in (run_dir / "transcripts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and any(r["status"] == "error" for r in rows)
        assert any(r["status"] != "error" and r["sampled_tokens"] > 0 and r["turns"][0]["prompt_text"] for r in rows)
    assert (run_dir / "transcripts" / "eval_000000.jsonl").is_file()
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"] and all("reward" in line for line in lines), lines


def test_rerunning_the_finished_run_adds_nothing_and_a_changed_config_is_refused(run, capsys):
    import ray

    from rl.train import main

    _, run_dir, _ = run
    before = (run_dir / "metrics.jsonl").read_bytes(), (run_dir / "errors.jsonl").read_bytes()
    args = ["--config", CONFIG, f"run.dir={run_dir}", *OVERRIDES]
    assert main(args) == 4  # finished: the summary again, with the code the run ended with
    assert "is a finished run (step 2)" in capsys.readouterr().out
    assert main([*args, "learner.lr=0.01"]) == 2
    assert "learner.lr:" in capsys.readouterr().err
    assert ((run_dir / "metrics.jsonl").read_bytes(), (run_dir / "errors.jsonl").read_bytes()) == before
    assert not ray.is_initialized() and not list(run_dir.glob("config.*.yaml"))
