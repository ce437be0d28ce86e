"""The warm start: one seed reaches every random choice; validation tasks avoid the training tasks;
training stops at the first check that reaches ``sft.target_success`` and says so when none does."""

import pytest

from rl.config import CONFIGS_ROOT, SEEDED_SECTIONS, ConfigError, SFTConfig, load_config

QUICKSTART = str(CONFIGS_ROOT / "exp" / "quickstart.yaml")


def test_the_run_seed_reaches_every_section():
    cfg = load_config(QUICKSTART, ["seed=5"])
    assert [getattr(cfg, s).seed for s in SEEDED_SECTIONS] == [5] * len(SEEDED_SECTIONS)


def test_a_section_seed_that_is_set_stays(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"defaults:\n  - {QUICKSTART}\nmodel:\n  seed: 9\n")
    cfg = load_config(exp, ["seed=5", "sft.seed=7"])
    assert (cfg.model.seed, cfg.sft.seed, cfg.learner.seed, cfg.rollout.seed) == (9, 7, 5, 5)


def test_the_seed_changes_the_warm_start_data():
    from rl.sft import expert_episodes

    ids = [[e.task_id for e in expert_episodes(SFTConfig(num_episodes=4, seed=s), {})] for s in (0, 1)]
    assert ids[0] != ids[1]
    assert ids[0] == [e.task_id for e in expert_episodes(SFTConfig(num_episodes=4, seed=0), {})]


def test_check_tasks_are_train_tasks_outside_the_warm_start_data():
    import envs
    from rl.sft import check_tasks, expert_episodes

    cfg = SFTConfig(num_episodes=300, num_check_tasks=40, seed=3)
    keys = {e.info["task_key"] for e in expert_episodes(cfg, {})}
    tasks = check_tasks(cfg, {}, keys)
    assert len(tasks) == 40 and all(t.options["split"] == "train" for t in tasks)
    env = envs.make("Calculator")
    check_keys = [env.task_for("train", 1, t.options["task_index"]).key for t in tasks]
    assert not set(check_keys) & keys
    assert check_tasks(cfg, {}, keys) == tasks  # a pure function of the config


def test_sft_env_kwargs_merge_over_the_env_kwargs():
    from rl.sft import sft_env_kwargs

    cfg = load_config(QUICKSTART, ["sft.env_kwargs.Calculator.difficulty=2", "env.kwargs.Calculator.max_turns=6"])
    shapes = cfg.env.kwargs["Calculator"]["operand_ranges"]
    assert sft_env_kwargs(cfg) == {"Calculator": {"difficulty": 2, "max_turns": 6, "operand_ranges": shapes}}
    assert cfg.env.kwargs["Calculator"]["difficulty"] == 1  # RL's own kwargs are untouched


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_target_success_out_of_range_is_rejected(value):
    with pytest.raises(ConfigError, match=r"sft\.target_success"):
        load_config(QUICKSTART, [f"sft.target_success={value}"])


class _CountingLearner:
    """Counts SFT steps (the loop's bookkeeping is under test here, not the optimiser)."""

    def __init__(self) -> None:
        self.steps = 0

    def sft_step(self, batch) -> dict:
        self.steps += 1
        return {"sft/nll": 1.0 / self.steps}


def _episodes(n: int):
    from rl.sft import expert_episodes

    return expert_episodes(SFTConfig(num_episodes=n), {})


def test_sft_stops_at_the_first_check_that_reaches_the_target():
    from rl.sft import run_sft

    cfg = SFTConfig(num_episodes=40, batch_episodes=1, epochs=1, target_success=0.5, check_every=5)
    learner, seen = _CountingLearner(), []

    def check(lr):
        seen.append(lr.steps)
        return {5: 0.0, 10: 0.25, 15: 0.6}.get(lr.steps, 1.0)

    lines: list[str] = []
    out = run_sft(learner, _episodes(40), cfg, 100_000, log=lines.append, check=check)
    assert learner.steps == 15 and seen == [5, 10, 15]
    assert out["sft/target_reached"] == 1.0 and out["sft/check_success"] == 0.6
    assert out["sft/check_history"] == [[5, 0.0], [10, 0.25], [15, 0.6]]
    assert not any("WARNING" in line for line in lines)


def test_sft_below_its_target_says_so():
    from rl.sft import run_sft

    cfg = SFTConfig(num_episodes=12, batch_episodes=1, epochs=1, max_steps=10, target_success=0.5, check_every=5)
    lines: list[str] = []
    out = run_sft(_CountingLearner(), _episodes(12), cfg, 100_000, log=lines.append, check=lambda lr: 0.1)
    assert out["sft/steps"] == 10 and out["sft/target_reached"] == 0.0
    assert any("WARNING" in line and "target success" in line for line in lines)


def test_sft_without_a_target_runs_its_steps():
    from rl.sft import run_sft

    cfg = SFTConfig(num_episodes=8, batch_episodes=2, epochs=2)
    out = run_sft(_CountingLearner(), _episodes(8), cfg, 100_000, log=lambda s: None, check=lambda lr: 1.0)
    assert out["sft/steps"] == 8 and "sft/target_reached" not in out


def test_a_warm_start_below_its_target_warns_in_the_summary(tmp_path):
    import json

    from rl.sft import warm_start_warnings

    assert warm_start_warnings(tmp_path) == []  # no warm start in this run
    (tmp_path / "sft_metrics.json").write_text(json.dumps({"sft/target_reached": 1.0}))
    assert warm_start_warnings(tmp_path) == []
    (tmp_path / "sft_metrics.json").write_text(
        json.dumps({"sft/target_reached": 0.0, "sft/steps": 2.0, "sft/check_success": 0.0})
    )
    (warning,) = warm_start_warnings(tmp_path)
    assert "after 2 steps" in warning and "sft.target_success" in warning
