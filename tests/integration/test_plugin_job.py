"""Plug-ins under ``ray job submit``: a user's env and reward live in a directory outside the repository
and are named only by the user's own config (outside too), whose ``ray.runtime_env.py_modules`` brings
them to the job: the driver's checks import them from there before Ray starts, the rollout workers from
Ray's copy. One job of one step on a local cluster of the test's own (scripts/ray_local.sh: own temp
dir, free ports), stopped at the end (that cluster only). docs/plugins.md lists the other ways."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl.config import CONFIGS_ROOT, ConfigError
from rl.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

ROOT = CONFIGS_ROOT.parent
RAY = str(Path(sys.executable).parent / "ray")
_spec = importlib.util.spec_from_file_location("ray_local", ROOT / "scripts" / "ray_local.py")
ray_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ray_local)
MODULE = "lh_job_plugin"
ENV = f"{MODULE}:ReverseEnv"
PLUGIN = textwrap.dedent('''
    """The env and reward of envs/README.md, in nobody's package; the env marks its episodes."""
    from envs import protocol
    from envs.base import Task, Tool, ToolEnv


    class ReverseEnv(ToolEnv):
        env_name = "Reverse"

        def make_tools(self):
            params = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
            return [Tool("reverse", "Reverse a word.", params, lambda word: word[::-1])]

        def generate_task(self, rng, difficulty):
            word = "".join(rng.choice(list("abcdef"), size=3 + difficulty))
            return Task(key=word, messages=[{"role": "user", "content": f"Reverse {word}."}], target=word[::-1])

        def expert_action(self):
            if self.turn == 0:
                return protocol.format_tool_call("reverse", {"word": self.task.key})
            return protocol.format_answer(self.task.target)

        def reset(self, *, seed=None, options=None):
            obs, info = super().reset(seed=seed, options=options)
            info["made_by"] = "lh_job_plugin"
            return obs, info


    def marked(episode, value=0.0):
        """``value`` for an episode of ReverseEnv; any other env's episode raises (a reward error)."""
        assert episode.info["made_by"] == "lh_job_plugin", episode.info
        return value
''')


def user_config(tmp_path: Path, with_runtime_env: bool = True) -> Path:
    """The user's experiment: the CI-sized pipeline with their env and reward, one step, no warm start."""
    ray_section = f"ray:\n  runtime_env:\n    py_modules: ['{tmp_path / 'plugin' / MODULE}']\n"
    text = textwrap.dedent(f"""\
        defaults:
          - {CONFIGS_ROOT / "exp" / "ci_tiny.yaml"}
        name: plugin_job
        env:
          mix: {{'{ENV}': 1.0}}
          eval_env: '{ENV}'
          num_eval_tasks: 2
        reward:
          functions:
            - {{fn: '{MODULE}:marked', kwargs: {{value: 0.25}}}}
        sft:
          enabled: false
        curriculum:
          stages: []
          steps: 1
          niah:
            enabled: false
        rollout:
          tasks_per_step: 1
          group_size: 2
          max_turns: 2
          max_tokens_per_turn: 16
        run:
          dir: {tmp_path / "run"}
          plots: false
          tensorboard: false
        """)  # fmt: skip
    path = tmp_path / ("mine.yaml" if with_runtime_env else "mine_bare.yaml")
    path.write_text(text + (ray_section if with_runtime_env else ""))
    return path


@pytest.fixture
def cluster():
    """A local cluster started from the repository root as scripts/quickstart.sh starts it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    start = "source scripts/env.sh && source scripts/ray_local.sh && ray_local_start --num-cpus=2 " \
            "--object-store-memory=500000000"  # fmt: skip
    out = subprocess.run(
        ["bash", "-c", start], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    m = re.search(r"ray cluster: temp dir (\S+), GCS (\S+), dashboard (\S+)", out.stdout)
    try:
        assert out.returncode == 0 and m, out.stdout + out.stderr
        yield m.group(3), env
    finally:
        if m:
            ray_local.stop(m.group(1))
            subprocess.run(["rm", "-rf", m.group(1)])


def test_a_job_trains_on_an_env_and_reward_from_outside_the_repo(tmp_path, cluster):
    from rl.train import parse

    (tmp_path / "plugin" / MODULE).mkdir(parents=True)
    (tmp_path / "plugin" / MODULE / "__init__.py").write_text(PLUGIN)
    with pytest.raises(ConfigError, match=MODULE):  # without the runtime env nothing can import it
        parse(["--config", str(user_config(tmp_path, with_runtime_env=False))])
    dashboard, env = cluster
    cmd = [RAY, "job", "submit", "--address", dashboard, "--", "python", "-m", "rl.train", "--config",
           str(user_config(tmp_path))]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "succeeded" in log, log[-6000:]
    assert f"  env mix: {ENV} 1" in log and f"  reward: {MODULE}:marked x1" in log  # the plan, printed
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    step = next(r for r in rows if r["step"] == 1 and "learner/version" in r)
    assert step["reward/fn/marked"] == 0.25 and step["reward/fn_errors"] == 0  # every episode: ReverseEnv's
    evals = [r for r in rows if "eval/mean" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all(r["eval/fn/marked"] == 0.25 and r["eval/fn_errors"] == 0 for r in evals)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_env"] == ENV
