"""A user's own config, env and reward without surprises: data mixes replace the inherited ones unless
marked to extend them, the driver says what it will train on, and whatever can be checked before Ray
starts is (checkpoint directories, env kwargs of plug-ins, reward names), with the plug-ins that the
config's ``ray.runtime_env`` brings importable for those checks."""

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl.config import CONFIGS_ROOT, ConfigError, load_config, stages
from rl.preflight import add_runtime_env_paths, checkpoint_problem, plan_lines, runtime_env_paths
from rl.train import main, parse

CI_TINY = str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml")
QUICKSTART = str(CONFIGS_ROOT / "exp" / "quickstart.yaml")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def own_sys_path(monkeypatch):
    """add_runtime_env_paths changes sys.path: give it a copy that the test's end throws away."""
    monkeypatch.setattr(sys, "path", list(sys.path))


# --------------------------------------------------------------------------- mixes


@pytest.fixture
def layered(tmp_path):
    """base (a two-env mix) <- exp (its own mix) <- ext (a '+' mix on top of exp)."""
    write(
        tmp_path / "base.yaml",
        "env:\n  mix: {Calculator: 1.0, Countdown: 0.5}\nsft:\n  env_mix: {Calculator: 1.0}\n",
    )
    write(tmp_path / "exp.yaml", "defaults: [base]\nenv:\n  mix: {Python: 1.0}\n")
    write(
        tmp_path / "ext.yaml",
        "defaults: [exp]\nenv:\n  mix: {+RetrievalQA: 0.5}\nsft:\n  env_mix: {+Python: 2}\n",
    )
    return tmp_path


def test_an_experiments_mix_replaces_the_inherited_one(layered):
    merged = OmegaConf.merge(OmegaConf.load(layered / "base.yaml"), OmegaConf.load(layered / "exp.yaml"))
    assert set(merged.env.mix) == {"Calculator", "Countdown", "Python"}  # what a plain OmegaConf merge does
    cfg = load_config(layered / "exp.yaml")
    assert cfg.env.mix == {"Python": 1.0}
    assert stages(cfg)[0].mix == {"Python": 1.0}
    assert cfg.sft.env_mix == {"Calculator": 1.0}  # a mix the experiment does not set stays inherited


def test_plus_keys_extend_the_inherited_mix(layered, tmp_path):
    cfg = load_config(layered / "ext.yaml")
    assert cfg.env.mix == {"Python": 1.0, "RetrievalQA": 0.5}  # exp's mix (which replaced base's) + one
    assert cfg.sft.env_mix == {"Calculator": 1.0, "Python": 2.0}
    # a file whose defaults set no mix extends what lies below all of them: the schema's default
    write(tmp_path / "plain.yaml", "name: plain\n")
    write(tmp_path / "only_plus.yaml", "defaults: [plain]\nenv:\n  mix: {+Countdown: 1.0}\n")
    assert load_config(tmp_path / "only_plus.yaml").env.mix == {"Calculator": 1.0, "Countdown": 1.0}
    write(tmp_path / "mixed.yaml", "env:\n  mix: {+Countdown: 1.0, Python: 1.0}\n")
    with pytest.raises(ConfigError, match=r"env.mix: every key starts with '\+' .* or none does"):
        load_config(tmp_path / "mixed.yaml")


@pytest.mark.parametrize(
    ("overrides", "mix"),
    [
        (["env.mix={Countdown: 1.0}"], {"Countdown": 1.0}),  # a mapping replaces
        (["env.mix={+Countdown: 1.0}"], {"Python": 1.0, "Countdown": 1.0}),  # '+' keys extend
        (["env.mix.Countdown=0.5"], {"Python": 1.0, "Countdown": 0.5}),  # one entry's path sets that entry
        (["env.mix.Python=0.25"], {"Python": 0.25}),
        (["env.mix={Countdown: 1.0}", "env.mix.Python=2"], {"Countdown": 1.0, "Python": 2.0}),  # in order
    ],
)
def test_overrides_replace_a_mix_or_set_one_entry(layered, overrides, mix):
    assert load_config(layered / "exp.yaml", overrides).env.mix == mix


def test_a_mix_entry_without_weight_names_the_yaml_slip(layered):
    with pytest.raises(ConfigError, match=r"env.mix.Countdown:1.0: no weight .*write \{Countdown: 1.0\}"):
        load_config(layered / "exp.yaml", ["env.mix={Countdown:1.0}"])  # YAML: one key, no value


def test_stage_mixes_replace_or_extend_env_mix(layered):
    stages_override = (
        "curriculum.stages=[{name: a, mix: {+Countdown: 1}}, {name: b, mix: {Countdown: 1}}, {name: c}]"
    )
    cfg = load_config(layered / "exp.yaml", [stages_override])
    assert [s.mix for s in stages(cfg)] == [
        {"Python": 1.0, "Countdown": 1.0},
        {"Countdown": 1.0},
        {"Python": 1.0},
    ]
    with pytest.raises(ConfigError, match=r"a list .* is set as a whole"):  # not a TypeError traceback
        load_config(layered / "exp.yaml", [stages_override, "curriculum.stages.0.mix={Python: 1}"])


def test_a_users_config_on_the_quickstart_trains_on_its_env_and_says_what_the_warm_start_uses(tmp_path):
    user = write(tmp_path / "mine.yaml", f"defaults: [{QUICKSTART}]\nenv:\n  mix: {{Countdown: 1.0}}\n")
    cfg = load_config(user)
    assert cfg.env.mix == {"Countdown": 1.0} and stages(cfg)[0].mix == {"Countdown": 1.0}
    lines = plan_lines(cfg)
    assert "  env mix: Countdown 1" in lines
    steps, sft = cfg.curriculum.steps, cfg.sft  # the quickstart's own numbers, whatever they are now
    assert any(line.startswith(f"  stage main (steps 1-{steps}): mix Countdown 1;") for line in lines)
    warm = next(line for line in lines if line.startswith("  warm start:"))
    assert f"{sft.num_episodes} expert episodes from Calculator 1" in warm
    assert f"reaches {sft.target_success:.0%}" in warm
    assert any("note: the warm start's envs (Calculator) are none of those RL trains on (Countdown)" in line
               for line in lines)  # fmt: skip


def test_the_plan_is_printed_before_ray_starts(capsys, tmp_path, monkeypatch):
    import rl.train

    class RayStarts(Exception):
        pass

    def connect_ray(*args, **kwargs):
        raise RayStarts

    monkeypatch.setattr(rl.train, "connect_ray", connect_ray)
    init = checkpoint_dir(tmp_path / "ckpt")
    with pytest.raises(RayStarts):
        main(["--config", CI_TINY, f"run.dir={tmp_path / 'run'}", f"model.init_from={init}",
              "curriculum.stages=[]", "curriculum.steps=1", "env.mix={Calculator: 3, Countdown: 1}"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0]
        == f"plan: grpo, 1 steps in 1 stage(s), run dir {tmp_path / 'run'}; held-out eval on Calculator (4 tasks)"
    )
    assert out[1:3] == [
        "  env mix: Calculator 3 (75%), Countdown 1 (25%)",
        "  env kwargs: Calculator difficulty=1, operand_ranges={'-': [[10, 99], [2, 9]], '*': [[2, 9], [10, 99]]}",
    ]
    assert out[3].startswith(
        "  stage main (step 1): mix Calculator 3 (75%), Countdown 1 (25%); 2 tasks x 4 episodes"
    )
    assert out[4:6] == ["  reward: the env's own", f"  start: model.init_from={init} (no warm start)"]


# --------------------------------------------------------------------------- checkpoints


def checkpoint_dir(path: Path, model_type: str = "longhorizon_hybrid", weights: bool = True) -> Path:
    """A directory that looks like a checkpoint to the pre-flight check (it reads files, loads nothing)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if weights:
        (path / "model.safetensors").write_bytes(b"\0")
    return path


def test_missing_init_from_is_one_line_exit_2_in_seconds_before_ray(capsys, tmp_path):
    import ray

    run_dir = tmp_path / "run"
    t0 = time.time()
    rc = main(["--config", CI_TINY, f"model.init_from={tmp_path / 'nonexistent'}", f"run.dir={run_dir}"])
    elapsed = time.time() - t0
    err = capsys.readouterr().err
    assert rc == 2 and elapsed < 10, (rc, elapsed)
    assert err.strip().splitlines() == [
        f"config error: model.init_from='{tmp_path / 'nonexistent'}': no such directory"
    ]
    assert "Traceback" not in err and not ray.is_initialized() and not run_dir.exists()


def test_checkpoint_problems_are_named(tmp_path):
    assert checkpoint_problem(checkpoint_dir(tmp_path / "ok")) is None
    (tmp_path / "file").write_text("x")
    assert "not a directory" in checkpoint_problem(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in checkpoint_problem(tmp_path / "empty")
    assert "model_type 'llama'" in checkpoint_problem(checkpoint_dir(tmp_path / "llama", model_type="llama"))
    assert "no weights" in checkpoint_problem(checkpoint_dir(tmp_path / "bare", weights=False))
    broken = checkpoint_dir(tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    assert "config.json is unreadable" in checkpoint_problem(broken)
    with pytest.raises(ConfigError, match=r"^model.init_from='.*empty': no config.json"):
        parse(["--config", CI_TINY, f"model.init_from={tmp_path / 'empty'}"])
    parse(["--config", CI_TINY, f"model.init_from={tmp_path / 'ok'}"])


def test_a_warm_start_directory_is_checked_before_it_is_loaded_or_replaced(tmp_path):
    base = ["--config", CI_TINY, f"run.dir={tmp_path / 'run'}"]
    parse([*base, f"sft.output_dir={tmp_path / 'new'}"])  # absent: the warm start writes it
    (tmp_path / "empty").mkdir()
    parse([*base, f"sft.output_dir={tmp_path / 'empty'}"])
    write(tmp_path / "notes" / "todo.txt", "mine")
    with pytest.raises(
        ConfigError, match=r"sft.output_dir=.*exists and is not a checkpoint; the warm start would replace it"
    ):
        parse([*base, f"sft.output_dir={tmp_path / 'notes'}"])
    checkpoint_dir(tmp_path / "half", weights=False)
    with pytest.raises(ConfigError, match="would be loaded as the finished warm start: no weights"):
        parse([*base, f"sft.output_dir={tmp_path / 'half'}"])
    parse([*base, f"sft.output_dir={tmp_path / 'notes'}", "sft.enabled=false"])  # not used: not checked


# --------------------------------------------------------------------------- env kwargs and rewards


PLUGIN_ENV = '''
    """A plug-in env with explicit constructor parameters (the unit converter of a user)."""
    from envs.calculator import CalculatorEnv


    class UnitEnv(CalculatorEnv):
        def __init__(self, difficulty=0, units="metric"):
            super().__init__(difficulty=difficulty)
            self.units = units


    def unit_reward(episode, scale=1.0):
        return scale * float(episode.info.get("solved", False))
'''


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "env.kwargs.Calculator.dificulty=1",
            "env.kwargs.Calculator.dificulty: unknown field; did you mean difficulty?",
        ),
        (
            "sft.env_kwargs.Calculator.dificulty=1",
            "sft.env_kwargs.Calculator.dificulty: unknown field; did you mean difficulty?",
        ),
        ("reward.functions=[{fn: solvd}]", "did you mean 'solved'?"),
    ],
)
def test_misspelt_env_kwargs_and_reward_names_fail_with_a_suggestion(capsys, override, message):
    assert main(["--config", CI_TINY, override]) == 2
    assert message in capsys.readouterr().err


def test_eval_env_and_plugin_env_kwargs_are_checked_with_the_plugin_from_the_runtime_env(
    tmp_path, own_sys_path
):
    """The plug-in lives in a directory only ``ray.runtime_env.py_modules`` names: the driver's checks
    import it from there, and its constructor's parameters are what the kwargs are checked against."""
    write(tmp_path / "unitpkg" / "__init__.py", PLUGIN_ENV)
    env = "unitpkg:UnitEnv"
    base = ["--config", CI_TINY, f"ray.runtime_env={{py_modules: ['{tmp_path / 'unitpkg'}']}}",
            f"env.mix={{'{env}': 1.0}}", f"env.eval_env={env}", "sft.enabled=false",
            "reward.functions=[{fn: 'unitpkg:unit_reward', kwargs: {scale: 2.0}}]"]  # fmt: skip
    assert "unitpkg" not in sys.modules
    with pytest.raises(
        ConfigError, match=rf"env.kwargs.{env}.dificulty: unknown field; did you mean difficulty\?"
    ):
        parse([*base, f"env.kwargs={{'{env}': {{dificulty: 1}}}}"])
    cfg = parse([*base, f"env.kwargs={{'{env}': {{difficulty: 1, units: imperial}}}}"])
    assert cfg.env.eval_env == env and str(tmp_path) in sys.path
    with pytest.raises(
        ConfigError, match=r"env.kwargs.Countdown.dificulty: unknown field; did you mean difficulty\?"
    ):
        parse(
            ["--config", CI_TINY, "env.eval_env=Countdown", "env.kwargs.Countdown.dificulty=2"]
        )  # eval env too


# --------------------------------------------------------------------------- ray.runtime_env on the driver


def test_runtime_env_paths_follow_what_ray_makes_importable(tmp_path, monkeypatch):
    write(tmp_path / "wd" / "x.py", "")
    write(tmp_path / "mods" / "pkg" / "__init__.py", "")
    write(tmp_path / "single" / "one.py", "")
    (tmp_path / "dist.whl").write_bytes(b"")
    monkeypatch.setenv("LH_EXTRA", str(tmp_path / "extra"))
    env = {
        "working_dir": "wd",
        "py_modules": [str(tmp_path / "mods" / "pkg"), "single/one.py", "dist.whl", "s3://bucket/remote.zip"],
        "env_vars": {"PYTHONPATH": f"{tmp_path / 'pp'}:${{LH_EXTRA}}", "OTHER": "1"},
    }
    assert runtime_env_paths(env, cwd=tmp_path) == [
        str(tmp_path / "wd"), str(tmp_path / "mods"), str(tmp_path / "single"), str(tmp_path / "dist.whl"),
        str(tmp_path / "pp"), str(tmp_path / "extra"),
    ]  # fmt: skip
    assert runtime_env_paths({"working_dir": "https://host/wd.zip"}, cwd=tmp_path) == []
    with pytest.raises(
        ConfigError, match=r"ray.runtime_env.py_modules\[0\]='nope': no such file or directory"
    ):
        runtime_env_paths({"py_modules": ["nope"]}, cwd=tmp_path)


def test_entry_points_of_a_package_on_the_runtime_envs_pythonpath_resolve(tmp_path, own_sys_path):
    """An installed package's entry points, here a dist-info that env_vars.PYTHONPATH brings (as a
    ``pip install --target`` directory would): the driver finds them by name."""
    write(tmp_path / "site" / "lh_unit_ep.py", PLUGIN_ENV)
    dist = tmp_path / "site" / "lh_unit_ep-0.1.dist-info"
    write(dist / "METADATA", "Metadata-Version: 2.1\nName: lh-unit-ep\nVersion: 0.1\n")
    write(dist / "entry_points.txt", "[longhorizon.envs]\nunit_ep = lh_unit_ep:UnitEnv\n\n"
                                     "[longhorizon.rewards]\nunit_ep_reward = lh_unit_ep:unit_reward\n")  # fmt: skip
    overrides = ["env.mix={unit_ep: 1.0}", "env.eval_env=unit_ep", "sft.enabled=false",
                 "reward.functions=[{fn: unit_ep_reward}]", "env.kwargs.unit_ep.difficulty=2"]  # fmt: skip
    with pytest.raises(ConfigError, match="unit_ep"):  # not reachable without the runtime env
        parse(["--config", CI_TINY, *overrides])
    pythonpath = f"ray.runtime_env={{env_vars: {{PYTHONPATH: '{tmp_path / 'site'}'}}}}"
    assert main(["--config", CI_TINY, *overrides, pythonpath, "env.kwargs.unit_ep.dificulty=2"]) == 2
    cfg = parse(["--config", CI_TINY, *overrides, pythonpath])
    assert cfg.env.mix == {"unit_ep": 1.0}
    assert add_runtime_env_paths(cfg.ray.runtime_env) == []  # already there: added once


def test_a_runtime_env_that_ray_would_not_merge_with_the_jobs_is_refused_before_ray():
    from rl.preflight import JOB_CONFIG_VAR, check_job_runtime_env

    job = {
        JOB_CONFIG_VAR: json.dumps({"runtime_env": {"py_modules": ["gcs://x.zip"], "env_vars": {"A": "1"}}})
    }
    check_job_runtime_env({"env_vars": {"B": "2"}, "working_dir": "."}, job)  # disjoint: Ray merges them
    check_job_runtime_env({"py_modules": ["p"]}, {})  # not a submitted job
    check_job_runtime_env({"py_modules": ["p"]}, {**job, "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"})
    with pytest.raises(
        ConfigError, match=r"ray.runtime_env sets py_modules, env_vars.A, which the submitted job"
    ):
        check_job_runtime_env({"py_modules": ["p"], "env_vars": {"A": "2"}}, job)
