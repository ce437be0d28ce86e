"""Run directories across invocations (rl/rundir.py): a resume under a changed config is refused with the
keys listed (force records the change), the config history, finished runs re-run without a new row,
fresh starts over an earlier attempt. No actor starts in any of these."""

import json
import sys
from pathlib import Path

import pytest

from rl import checkpoint
from rl.config import CONFIGS_ROOT, ConfigError, load_config, stages
from rl.rundir import RESUME_FREE_KEYS, config_history, open_run
from rl.train import main

CONFIG = CONFIGS_ROOT / "exp" / "ci_tiny.yaml"


def cfg_for(run_dir: Path, *overrides: str):
    return load_config(CONFIG, [f"run.dir={run_dir}", *overrides])


def total(cfg) -> int:
    return sum(s.steps for s in stages(cfg))


def started(run_dir: Path, step: int, *overrides: str):
    """A run dir as a run leaves it: config.yaml, a checkpoint at ``step``, metrics rows up to it."""
    cfg = cfg_for(run_dir, *overrides)
    open_run(cfg, total(cfg))
    checkpoint.save(run_dir, checkpoint.RunState(step=step, eval_before={"eval/success_rate": 0.25}),
                    lambda p: Path(p).write_text("learner"), keep=2)  # fmt: skip
    rows = [{"step": 0, "eval/success_rate": 0.25}] + [{"step": s, "learner/version": float(s)} for s in
                                                         range(1, step + 1)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cfg


def no_ray() -> bool:
    return "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_resuming_with_a_changed_config_is_refused_with_the_differing_keys(tmp_path, capsys):
    run = tmp_path / "r"
    cfg = started(run, 2)
    changed = ["curriculum.steps=5", "learner.lr=0.01", "rollout.group_size=2", "run.verbose=true",
               "run.stop_after_steps=1"]  # fmt: skip
    assert main(["--config", str(CONFIG), f"run.dir={run}", *changed]) == 2
    err = capsys.readouterr().err
    was = [("learner.lr", cfg.learner.lr, 0.01), ("rollout.group_size", cfg.rollout.group_size, 2),
           ("curriculum.steps", cfg.curriculum.steps, 5)]  # fmt: skip
    for key, old, new in was:
        assert old != new and f"{key}: {old!r} (the run) -> {new!r} (now)" in err, err
    assert "3 key(s)" in err and "run.verbose" not in err and "run.stop_after_steps" not in err
    assert "run.resume=force" in err and "checkpoint at step 2" in err
    assert [p.name for _, p in config_history(run)] == ["config.yaml"]  # nothing written
    assert no_ray()


def test_the_same_config_resumes_and_keeps_a_config_per_resume(tmp_path):
    run = tmp_path / "r"
    first = started(run, 2)
    again = cfg_for(tmp_path / "r", "run.verbose=true", "run.stop_after_steps=1", "ray.num_cpus=1")
    opened = open_run(again, total(again))
    assert opened.resume_from == checkpoint.latest(run) and opened.state.step == 2 and not opened.changes
    assert opened.config_version == 0 and opened.finished is None
    assert [p.name for _, p in config_history(run)] == ["config.yaml", "config.1.yaml"]
    assert (run / "config.1.yaml").read_text().startswith("# resumed at step 2 (run.resume=auto)")
    assert load_config(run / "config.yaml").learner.lr == first.learner.lr  # the start's config stays


def test_force_resumes_and_records_the_change(tmp_path):
    run = tmp_path / "r"
    lr = started(run, 2).learner.lr
    forced = cfg_for(run, "run.resume=force", "learner.lr=0.01", "env.mix={Countdown: 1.0}")
    opened = open_run(forced, total(forced))
    assert opened.resume_from is not None and opened.config_version == 1
    assert opened.changes == {"learner.lr": (lr, 0.01), "env.mix.Calculator": (1.0, "<absent>"),
                              "env.mix.Countdown": ("<absent>", 1.0)}  # fmt: skip
    (row,) = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert row["first_step"] == 3 and row["config"] == "config.1.yaml"
    assert row["changes"]["learner.lr"] == {"old": lr, "new": 0.01}
    assert load_config(run / "config.1.yaml").learner.lr == 0.01
    # the next plain resume compares with the forced config (the newest of the history) and goes on
    plain = cfg_for(run, "learner.lr=0.01", "env.mix={Countdown: 1.0}")
    again = open_run(plain, total(plain))
    assert not again.changes and again.config_version == 2  # still marked: the run's config changed once
    with pytest.raises(ConfigError, match=rf"learner\.lr: 0\.01 \(the run\) -> {lr!r} \(now\)"):
        open_run(cfg_for(run, "env.mix={Countdown: 1.0}"), total(plain))


def test_a_finished_run_prints_its_summary_and_adds_nothing(tmp_path, capsys):
    run = tmp_path / "r"
    cfg = started(run, 3)
    summary = {"status": "eval_failed", "exit_code": 4, "held_out_success_before": None}
    (run / "summary.json").write_text(json.dumps(summary))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert total(cfg) == 3
    assert main(["--config", str(CONFIG), f"run.dir={run}"]) == 4  # the code the run ended with
    out = capsys.readouterr().out
    assert "is a finished run (step 3)" in out and "longhorizon run summary" in out and "FAILED" in out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # no row, no file
    assert no_ray()


def test_a_finished_run_without_its_summary_drops_the_final_rows_it_redoes(tmp_path):
    run = tmp_path / "r"
    cfg = started(run, 3)
    with (run / "metrics.jsonl").open("a") as f:  # the final evaluation, logged before the crash
        f.write(json.dumps({"step": 3, "eval/success_rate": 0.5}) + "\n")
    (run / "errors.jsonl").write_text(json.dumps({"step": 3, "phase": "eval"}) + "\n"
                                      + json.dumps({"step": 3, "phase": "train"}) + "\n")  # fmt: skip
    opened = open_run(cfg, total(cfg))
    assert opened.finished is None and opened.state.step == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "learner/version" in rows[-1]
    assert [json.loads(line)["phase"] for line in (run / "errors.jsonl").read_text().splitlines()] == ["train"]


def test_fresh_starts_move_an_earlier_attempt_away(tmp_path):
    run = tmp_path / "r"
    cfg = cfg_for(run)
    open_run(cfg, total(cfg))
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # an attempt that never reached a checkpoint
    (run / "sft").mkdir()
    opened = open_run(cfg, total(cfg))
    assert opened.resume_from is None
    assert (run / "previous" / "1" / "metrics.jsonl").is_file() and not (run / "metrics.jsonl").exists()
    assert (run / "previous" / "1" / "config.yaml").is_file() and (run / "config.yaml").is_file()
    assert (run / "sft").is_dir()  # the warm start stays, to be reused
    started(run, 2)
    never = cfg_for(run, "run.resume=false", "learner.lr=0.01")  # false = never: start over here
    assert never.run.resume == "never"
    opened = open_run(never, total(never))
    assert opened.resume_from is None and checkpoint.latest(run) is None
    assert checkpoint.latest(run / "previous" / "3") is not None  # moved, not deleted
    assert load_config(run / "config.yaml").learner.lr == 0.01


def test_run_resume_values():
    assert load_config(None, ["run.resume=true"]).run.resume == "auto"
    assert load_config(None, ["run.resume=force"]).run.resume == "force"
    with pytest.raises(ConfigError, match=r"run\.resume.*got 'sometimes'"):
        load_config(None, ["run.resume=sometimes"])
    assert {"run.resume", "run.stop_after_steps", "run.verbose", "run.progress_bar", "run.dir", "ray"} <= set(
        RESUME_FREE_KEYS
    )


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_resume_drops_the_error_rows_of_what_it_redoes(tmp_path, in_flight):
    from rl_factories import group

    run = tmp_path / "r"
    cfg = started(run, 2)
    if in_flight:  # the checkpoint holds step 3's groups: their collection is not redone
        checkpoint.save(run, checkpoint.RunState(step=2, in_flight=[group([1.0, 0.0])]),
                        lambda p: Path(p).write_text("learner"), keep=2)  # fmt: skip
    rows = [(2, "train"), (2, "eval"), (3, "train"), (3, "eval")]  # a stopped run: step 3 failed to collect
    (run / "errors.jsonl").write_text("".join(json.dumps({"step": s, "phase": p}) + "\n" for s, p in rows))
    open_run(cfg, total(cfg))
    kept = [(r["step"], r["phase"]) for r in map(json.loads, (run / "errors.jsonl").read_text().splitlines())]
    assert kept == [(2, "train"), (2, "eval")] + ([(3, "train")] if in_flight else [])
