"""Reward modules in the loop, through the real entry point (``python -m rl.train``, local Ray, a vLLM
rollout worker): a third-party reward module (a file outside the packages, named "module:attr", found
on PYTHONPATH) scores training and evaluation, and a reward function that raises on some tasks is
counted, not fatal. The rewards are constant within each task, so no group has any variance: the
same run shows the no-learning-signal warning on the console and in summary.json. One run of three
steps; no warm start (the rewards come from the module, not from what the policy can do)."""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from rl.config import CONFIGS_ROOT, load_config
from rl.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

ROOT = CONFIGS_ROOT.parent
CONFIG = str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml")
MODULE = "lh_thirdparty_rewards"
PLUGIN = textwrap.dedent('''
    """A reward module of nobody's package."""


    def constant(episode, value=0.0):
        return value


    def fails_on_odd_tasks(episode):
        index = int(episode.info["task_id"].rsplit("/", 1)[1])
        if index % 2:
            raise ZeroDivisionError(f"odd task {index}")
        return 0.0
''')
OVERRIDES = [
    "sft.enabled=false",
    "curriculum.stages=[]",
    "curriculum.steps=3",
    "curriculum.niah.enabled=false",
    "run.save_every=1",
    "run.keep_checkpoints=3",
    "reward.error_reward=-1.0",
    f"reward.functions=[{{fn: '{MODULE}:constant', weight: 2.0, kwargs: {{value: 0.125}}}}, "
    f"{{fn: '{MODULE}:fails_on_odd_tasks', name: picky}}]",
]
CONSTANT = 2.0 * 0.125  # every episode's total when picky does not raise


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    plugin_dir = tmp_path_factory.mktemp("plugin")
    (plugin_dir / f"{MODULE}.py").write_text(PLUGIN)
    run_dir = tmp_path_factory.mktemp("runs") / "rewards"
    path = os.pathsep.join(p for p in (str(plugin_dir), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "rl.train", "--config", CONFIG, f"run.dir={run_dir}", *OVERRIDES]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]  # the raising function is not fatal
    return run_dir, out


def test_third_party_module_sets_the_training_rewards(run):
    run_dir, _ = run
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "learner/version" in r}
    assert sorted(rows) == [1, 2, 3]
    errors = 0.0
    for r in rows.values():
        assert r["reward/fn/constant"] == 0.125  # the module's value, unweighted
        e = r["reward/errors"]  # episodes of odd tasks: picky raised, the error reward instead
        assert r["reward/fn_errors"] == pytest.approx(e * 8)  # 2 tasks x 4 episodes per step
        assert r["reward/mean"] == pytest.approx(CONSTANT * (1 - e) - 1.0 * e)
        errors += e
    assert errors > 0, "no odd task in three steps: pick other overrides"
    # step 3's episodes, as collected (the step-2 checkpoint holds them in flight)
    with (run_dir / "checkpoints" / "step_000002" / "state.pkl").open("rb") as f:
        state = pickle.load(f)
    eps = [e for g in state.in_flight for e in g.episodes]
    odd = [int(e.info["task_id"].rsplit("/", 1)[1]) % 2 == 1 for e in eps]
    assert len(eps) == 8 and rows[3]["reward/errors"] == pytest.approx(sum(odd) / 8)
    for e, o in zip(eps, odd):
        assert e.reward == (-1.0 if o else CONSTANT) and e.reward_breakdown["constant"] == 0.125
        assert ("ZeroDivisionError: odd task" in e.info.get("reward_error", "")) == o


def test_third_party_module_sets_the_evaluation_rewards(run):
    run_dir, _ = run
    cfg = load_config(CONFIG, OVERRIDES)
    n = cfg.env.num_eval_tasks
    odd = sum((cfg.env.eval_offset + i) % 2 for i in range(n))
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/mean" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before and after RL
    for r in evals:
        assert r["eval/fn/constant"] == 0.125 and r["eval/fn_errors"] == odd
        assert r["eval/mean"] == pytest.approx((CONSTANT * (n - odd) - 1.0 * odd) / n)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_reward_before"] == pytest.approx(evals[0]["eval/mean"])


def test_rewards_without_variance_give_the_no_signal_warning(run):
    run_dir, out = run
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "learner/version" in r]
    assert all(r["signal/zero_variance_groups"] == r["signal/groups"] == 2 for r in rows)
    lines = [line for line in out.stdout.splitlines() if line.startswith("WARNING: no learning signal")]
    assert len(lines) == 1 and "for 3 consecutive steps (steps 1-3" in lines[0], out.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert any(w.startswith("no learning signal") and "Likely cause" in w for w in summary["warnings"])
    assert (
        lines[0] in out.stdout.split("longhorizon run summary")[0]
    )  # said when it happened, not only at the end
