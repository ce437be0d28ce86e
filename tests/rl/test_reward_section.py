"""The experiment config's ``reward`` section: built once and checked before any actor starts, then
scoring collection and evaluation (real episode loop, manager and driver collection on a plain
scripted worker; no engine, no Ray)."""

import dataclasses
import sys
import time
from types import SimpleNamespace

import pytest
from rl_factories import ScriptedWorker

from envs.types import EpisodeStatus
from rl.config import CONFIGS_ROOT, ConfigError, RewardConfig, load_config, stages
from rl.rollouts import collect_step, evaluate
from rl.train import build_reward, main

CONFIG = CONFIGS_ROOT / "exp" / "ci_tiny.yaml"


def reward_cfg(*functions: str, extra=()):
    return load_config(CONFIG, [f"reward.functions=[{', '.join(functions)}]", *extra])


@pytest.fixture(scope="module")
def renderer():
    from rollout.renderer import ChatRenderer

    return ChatRenderer()


def test_misspelt_reward_name_is_rejected_before_any_actor_starts(capsys):
    t0 = time.monotonic()
    bad = "reward.functions=[{fn: solved}, {fn: exact_mach, weight: 2}]"
    assert main(["--config", str(CONFIG), bad]) == 2
    err = capsys.readouterr().err
    assert "reward.functions[1]" in err and "exact_mach" in err and "did you mean 'exact_match'" in err
    assert time.monotonic() - t0 < 60
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{fn: 'rewards.builtin:exact_mtch'}", "has no attribute 'exact_mtch' (did you mean 'exact_match'?)"),
        ("{fn: 'no_such_module_xyz:f'}", "cannot import module 'no_such_module_xyz'"),
        ("{fn: turn_penalty, kwargs: {per_turn_cst: 0.1}}", "'per_turn_cst' (did you mean 'per_turn_cost'?)"),
        ("{fn: solved}, {fn: 'rewards.builtin:solved'}", "name 'solved' is already used"),
    ],
)
def test_bad_reward_entries_are_config_errors_naming_the_entry(entry, message):
    with pytest.raises(ConfigError, match=r"reward\.functions") as e:
        build_reward(reward_cfg(entry).reward)
    assert message in str(e.value)


def test_reward_section_builds_one_rubric_with_names_weights_and_kwargs():
    rubric = build_reward(reward_cfg("{fn: solved, weight: 2}", "{fn: turn_penalty, name: turns, kwargs: "
                                     "{per_turn_cost: 0.5}}", extra=["reward.truncated_reward=-1"]).reward)  # fmt: skip
    assert [(t.name, t.weight) for t in rubric.terms] == [("solved", 2.0), ("turns", 1.0)]
    assert rubric.truncated_reward == -1.0 and rubric.error_reward == 0.0
    assert build_reward(RewardConfig()) is None  # no section: the env's reward, as before


def _collect(renderer, cfg, rubric, step=1):
    pool = SimpleNamespace(workers=[ScriptedWorker(renderer)])
    stage = dataclasses.replace(stages(cfg)[0], tasks_per_step=6)
    return collect_step(pool, cfg.env, cfg.rollout, cfg.algorithm, stage, cfg.seed, step, rubric), stage, pool


def _odd(e) -> bool:
    return bool(int(e.info["task_id"].rsplit("/", 1)[1]) % 2)


def test_a_raising_reward_function_is_counted_and_the_collection_goes_on(renderer):
    cfg = reward_cfg("{fn: 'rl_factories:fails_on_odd_tasks', name: picky}", "{fn: solved, weight: 3}",
                     extra=["reward.error_reward=-1"])  # fmt: skip
    c, stage, pool = _collect(renderer, cfg, build_reward(cfg.reward))
    eps = [e for g in c.groups for e in g.episodes]
    odd = sum(_odd(e) for e in eps)
    assert 0 < odd < len(eps), "pick a seed whose tasks mix odd and even indices"
    for e in eps:
        assert e.status == EpisodeStatus.COMPLETED
        assert "solved" in e.reward_breakdown  # the other term is still scored
        if _odd(e):
            assert e.reward == -1.0 and "ZeroDivisionError: odd task" in e.info["reward_error"]
            assert "picky" not in e.reward_breakdown
        else:
            assert e.reward == pytest.approx(0.5 + 3 * e.reward_breakdown["solved"])
            assert "reward_error" not in e.info
    m = c.metrics
    assert m["reward/fn_errors"] == odd and m["reward/errors"] == pytest.approx(odd / len(eps))
    assert m["reward/fn/picky"] == 0.5
    assert m["reward/mean"] == pytest.approx(sum(e.reward for e in eps) / len(eps))
    assert len(c.groups) == stage.tasks_per_step  # nothing dropped: the episodes train with the error reward
    ev = evaluate(pool, cfg.env, cfg.rollout, stage, build_reward(cfg.reward))
    n_odd = sum((cfg.env.eval_offset + i) % 2 for i in range(cfg.env.num_eval_tasks))
    assert ev["eval/fn_errors"] == n_odd and ev["eval/fn/picky"] == 0.5 and "eval/fn/solved" in ev


def test_without_a_reward_section_the_episode_reward_is_the_env_reward(renderer):
    cfg = load_config(CONFIG)
    c, _, _ = _collect(renderer, cfg, build_reward(cfg.reward))
    eps = [e for g in c.groups for e in g.episodes]
    assert all(e.reward == e.env_reward and e.reward_breakdown == {} for e in eps)
    assert not any(k.startswith("reward/fn") for k in c.metrics)
