"""Failure handling with real Ray actors and real vLLM rollout workers: bad configs, a crashing env,
a rollout worker killed in the middle of a step, a rollout worker whose engine fails in the middle of one."""

import dataclasses
import sys
from pathlib import Path

import pytest

from rl.config import CONFIGS_ROOT, load_config, stages

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

pytestmark = [pytest.mark.ray, pytest.mark.vllm]


def test_bad_config_fails_before_any_actor_starts(capsys):
    import ray

    from rl.train import main

    assert main(["--config", str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml"), "learner.lrr=1"]) == 2
    assert "learner.lrr" in capsys.readouterr().err
    assert main(["--config", str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml"), "env.mix={NoSuchEnv: 1.0}"]) == 2
    assert "NoSuchEnv" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    import ray

    from rl.learner import Learner
    from rl.rollouts import WorkerPool, prepare_model_dir

    cfg = load_config(CONFIGS_ROOT / "exp" / "ci_tiny.yaml", ["rollout.max_episode_retries=1"])
    learner = Learner(cfg.model, cfg.learner, cfg.algorithm)  # random init: episodes are short garbage
    update = learner.export_weights(str(tmp_path_factory.mktemp("weights")))
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=500_000_000)
    p = WorkerPool(cfg.rollout, prepare_model_dir(update.path), update.version)
    yield cfg, p
    p.shutdown()
    ray.shutdown()


def stage_with(cfg, env_name, tasks=4):
    s = stages(cfg)[0]
    return dataclasses.replace(s, mix={env_name: 1.0}, tasks_per_step=tasks)


def test_crashing_env_episodes_are_counted_and_kept_out_of_the_loss(pool):
    from rl.rollouts import collect_step, train_tasks

    cfg, p = pool
    stage = stage_with(cfg, "crashing_envs:HalfCrashingCalculator")
    odd = sum(t.options["task_index"] % 2 for t in train_tasks(cfg.env, stage, cfg.seed, 1))
    assert 0 < odd < 4, "pick a seed whose tasks mix crashing and healthy ones"
    # more than half of them crash (3 of 4 tasks): by default that stops the run, so allow it here
    rcfg = dataclasses.replace(cfg.rollout, max_env_error_fraction=1.0)
    c = collect_step(p, cfg.env, rcfg, cfg.algorithm, stage, cfg.seed, 1)
    assert c.metrics["rollout/env_errors"] == odd * stage.group_size
    assert c.metrics["rollout/env_errors/crashing_envs:HalfCrashingCalculator"] == odd * stage.group_size
    crashed = [e for e in c.episodes if e.status == "error"]
    assert len(crashed) == odd * stage.group_size
    assert all(e.info["error_location"].startswith(str(HERE / "crashing_envs.py:")) for e in crashed)
    assert c.metrics["reward/errors"] == pytest.approx(odd / 4)
    assert len(c.groups) == 4 - odd
    assert all(e.status != "error" for g in c.groups for e in g.episodes)


def test_env_that_always_crashes_stops_the_run_with_its_message(pool):
    from rl.rollouts import collect_step

    cfg, p = pool
    stage = stage_with(cfg, "crashing_envs:AlwaysCrashingCalculator", tasks=2)
    with pytest.raises(RuntimeError, match="tool server unreachable"):
        collect_step(p, cfg.env, cfg.rollout, cfg.algorithm, stage, cfg.seed, 1)


def test_worker_killed_mid_step_is_replaced_and_its_groups_rerun(pool):
    import crashing_envs

    from rl.rollouts import collect_step

    cfg, p = pool
    stage = stage_with(cfg, "crashing_envs:WorkerKillingCalculator", tasks=2)
    crashing_envs.KILL_ON_STEP.append(p.workers[0])  # the first env step kills the worker
    restarts = p.restarts
    c = collect_step(p, cfg.env, cfg.rollout, cfg.algorithm, stage, cfg.seed, 1)
    assert not crashing_envs.KILL_ON_STEP
    assert c.metrics["rollout/worker_retries"] == 1 and p.restarts == restarts + 1
    assert len(c.groups) == 2 and all(len(g.episodes) == stage.group_size for g in c.groups)
    assert all(e.status != "error" for g in c.groups for e in g.episodes)


def test_worker_whose_engine_fails_mid_step_is_replaced_and_its_groups_rerun(pool):
    """The worker lives on but its engine raised mid-turn (its requests and states may be inconsistent): it
    answers the driver's ping with that error (``RolloutWorker.get_version``), so it is killed and replaced
    like a dead one and its groups re-run; before, it kept its broken engine and failed every retry."""
    import crashing_envs

    from rl.rollouts import collect_step

    cfg, p = pool
    stage = stage_with(cfg, "crashing_envs:EngineBreakingCalculator", tasks=2)
    broken = p.workers[0]
    crashing_envs.BREAK_ENGINE_ON_STEP.append(broken)
    restarts = p.restarts
    c = collect_step(p, cfg.env, cfg.rollout, cfg.algorithm, stage, cfg.seed, 1)
    assert not crashing_envs.BREAK_ENGINE_ON_STEP
    assert c.metrics["rollout/worker_retries"] == 1 and p.restarts == restarts + 1 and p.workers[0] is not broken
    assert len(c.groups) == 2 and all(len(g.episodes) == stage.group_size for g in c.groups)
    assert all(e.status != "error" for g in c.groups for e in g.episodes)


def test_worker_that_keeps_dying_fails_the_step_clearly(pool):
    import crashing_envs

    from rl.rollouts import collect_step

    cfg, p = pool
    stage = stage_with(cfg, "crashing_envs:WorkerKillingCalculator", tasks=1)
    crashing_envs.KILL_ON_STEP.append(p.workers[0])
    rcfg = dataclasses.replace(cfg.rollout, max_episode_retries=0)
    with pytest.raises(RuntimeError, match="rollout worker failed"):
        collect_step(p, cfg.env, rcfg, cfg.algorithm, stage, cfg.seed, 1)
