"""Config schema: composition, overrides, and clear rejection of bad configs."""

from pathlib import Path

import pytest

from rl import algorithms
from rl.config import CONFIGS_ROOT, ConfigError, TrainConfig, load_config, stages, to_yaml


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_schema_defaults_load_without_files():
    cfg = load_config(None)
    assert isinstance(cfg, TrainConfig)
    assert cfg.algorithm.baseline == "group_mean"  # filled from the grpo preset


@pytest.mark.parametrize("name", sorted(algorithms.PRESETS))
def test_every_preset_resolves_and_validates(name):
    cfg = load_config(None, [f"algorithm.name={name}"])
    assert all(getattr(cfg.algorithm, k) is not None for k in algorithms.PRESETS[name])


def test_explicit_values_beat_the_preset():
    cfg = load_config(None, ["algorithm.name=dapo", "algorithm.clip_high=0.5"])
    assert cfg.algorithm.clip_high == 0.5 and cfg.algorithm.clip_low == 0.2


def test_defaults_composition_and_override_order(tmp_path):
    write(tmp_path, "base.yaml", "name: base\nlearner:\n  lr: 0.1\nrollout:\n  group_size: 4\n")
    (tmp_path / "model").mkdir()
    exp = write(tmp_path, "exp.yaml", "defaults:\n  - base\nname: exp\nrollout:\n  group_size: 6\n")
    cfg = load_config(exp, ["learner.lr=0.5"])
    assert (cfg.name, cfg.learner.lr, cfg.rollout.group_size) == ("exp", 0.5, 6)
    assert cfg.run.dir == "runs/exp"  # interpolation resolved against the final name


def test_group_default_lands_under_model_arch(tmp_path, monkeypatch):
    import rl.config as rc

    (tmp_path / "model").mkdir()
    write(tmp_path / "model", "toy.yaml", "hidden_size: 32\nnum_hidden_layers: 2\n")
    monkeypatch.setattr(rc, "CONFIGS_ROOT", tmp_path)
    exp = write(tmp_path, "exp.yaml", "defaults:\n  - model: toy\n")
    assert load_config(exp).model.arch == {"hidden_size": 32, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["learner.lrr=1"], "learner.lrr"),
        (["learner.lr=abc"], "learner.lr"),
        (["rollout.group_size=two"], "rollout.group_size"),
        (["algorithm.name=nope"], "unknown algorithm 'nope'"),
        (["rollout.group_size=1"], "needs group_size >= 2"),
        (["algorithm.name=ppo", "algorithm.vf_coef=0"], "value head"),
        (["algorithm.credit=gae"], "baseline=value"),
        (["learner.device=cpu", "learner.dtype=bfloat16"], "bfloat16"),
        (["rollout.max_tokens_per_turn=4096", "rollout.max_context_tokens=1024"], "max_tokens_per_turn"),
        (["algorithm.clip_low=1.5"], "clip_low"),
        (["env.mix={Calculator: -1.0}"], "env.mix"),
        (
            ["algorithm.name=rloo", "algorithm.dynamic_sampling=true", "algorithm.baseline=batch_mean"],
            "dynamic_sampling",
        ),
        (["no_equals_sign"], "key=value"),
    ],
)
def test_bad_configs_are_rejected_with_the_key_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(None, overrides)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    exp = write(tmp_path, "exp.yaml", "learner:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"exp.yaml.*learner.learning_rate"):
        load_config(exp)


def test_missing_file_and_defaults_cycle(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    a = write(tmp_path, "a.yaml", "defaults:\n  - b\n")
    write(tmp_path, "b.yaml", "defaults:\n  - a\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(a)


def test_stage_fill_in_and_stage_rules():
    cfg = load_config(
        None, ["curriculum.stages=[{name: a, steps: 2, max_context_tokens: 512}, {name: b, steps: 1}]"]
    )
    s = stages(cfg)
    assert [x.max_context_tokens for x in s] == [512, cfg.rollout.max_context_tokens]
    assert s[1].group_size == cfg.rollout.group_size and s[1].mix == cfg.env.mix
    with pytest.raises(ConfigError, match=r"stages\[0\]"):
        load_config(None, ["curriculum.stages=[{name: a, steps: 1, max_context_tokens: 32}]"])


def test_roundtrip_yaml():
    cfg = load_config(None)
    assert "algorithm:" in to_yaml(cfg)


def test_checked_in_configs_resolve():
    for path in sorted((CONFIGS_ROOT / "exp").glob("*.yaml")):
        load_config(path)
    load_config(CONFIGS_ROOT / "base.yaml")
