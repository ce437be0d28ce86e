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
        (
            ["learner.num_workers=4", "learner.expert_parallel=3"],
            "learner.expert_parallel: must be >= 1 and divide",
        ),
        (
            ["learner.num_workers=2", "learner.expert_parallel=2", "learner.lora.enabled=true"],
            "learner.expert_parallel: > 1 does not shard LoRA",
        ),
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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.arch.hiden_size=3", "model.arch.hiden_size: unknown field; did you mean hidden_size?"),
        ("model.arch.linear_attn_config.num_head=2", "model.arch.linear_attn_config.num_head: unknown field"),
        ("model.arch.num_hidden_layers=3", "model.arch: kda_layers + full_attn_layers must cover"),
        ("rollout.engine.kv_cache_memroy_bytes=1", "did you mean kv_cache_memory_bytes?"),
        ("rollout.engine.seed=1", "rollout.engine.seed: set by the driver; use rollout.seed"),
        (
            "env.kwargs.Calculator.difficultly=2",
            "env.kwargs.Calculator.difficultly: unknown field; did you mean difficulty?",
        ),
        (
            "env.kwargs.NeedleHaystack.context_char=300",
            "did you mean context_chars?",
        ),  # **kwargs followed to ToolEnv
        (
            "env.kwargs.Calculater.difficulty=2",
            "env.kwargs.Calculater: unknown env; did you mean Calculator?",
        ),
        ("sft.env_kwargs.Calculator.dificulty=1", "sft.env_kwargs.Calculator.dificulty: unknown field"),
    ],
)
def test_unknown_nested_keys_are_rejected_by_name_before_any_actor_starts(override, message):
    from rl.train import parse

    with pytest.raises(ConfigError) as e:
        parse(["--config", str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml"), override])
    assert message in str(e.value)


def test_nested_keys_that_exist_pass_and_checked_in_configs_are_clean():
    from rl.config import check_nested_keys

    ok = ["env.kwargs.NeedleHaystack.difficulty=2", "env.kwargs.Python.sandbox_limits={}",
          "env.kwargs.Countdown.max_episode_steps=3", "rollout.engine.reuse=none", "model.init_from=somewhere",
          "model.arch.linear_attn_config.kda_layers=[1, 2, 3]"]  # fmt: skip
    check_nested_keys(load_config(CONFIGS_ROOT / "exp" / "ci_tiny.yaml", ok))
    for path in sorted((CONFIGS_ROOT / "exp").glob("*.yaml")):
        check_nested_keys(load_config(path))


def test_env_kwarg_names_follow_in_tree_kwargs_but_not_plugins():
    import gymnasium

    from rl.config import env_kwarg_names

    class Plugin(gymnasium.Env):
        def __init__(self, size=3, **options):
            self.size, self.options = size, options

    assert {"context_chars", "difficulty", "max_turns"} <= env_kwarg_names("NeedleHaystack")
    assert "context_chars" not in env_kwarg_names("Calculator")
    assert env_kwarg_names(Plugin) is None  # a plug-in's **kwargs may go anywhere
