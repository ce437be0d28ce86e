"""What a run leaves a user to debug with, and how it fails: env failures recorded with the user's file
and line (errors.jsonl, the console, per-env metrics), a step where most episodes fail stops the run,
a failed evaluation is reported as failed, sample transcripts, per-step console lines, plots. The real
episode loop, manager and driver collection run on a plain scripted worker (no engine, no Ray)."""

import dataclasses
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import rl_factories
from rl_factories import ScriptedWorker, episode, turn

from envs.types import EpisodeStatus
from rl.config import load_config, stages
from rl.errors import EXIT_EVAL_FAILED, EnvFailure, ErrorLog, read_errors, truncate_errors
from rl.metrics import PLOTS, MetricsLogger, summary_text
from rl.rollouts import collect_step, run_evaluation
from rl.transcripts import TranscriptWriter, sample_episodes

CRASHING = "rl_factories:OddCrashingCalculator"
RAISE_LINE = next(i for i, line in enumerate(inspect.getsource(rl_factories).splitlines(), 1)
                  if "raise ConnectionError" in line)  # fmt: skip


@pytest.fixture(scope="module")
def renderer():
    from rollout.renderer import ChatRenderer

    return ChatRenderer()


def config(mix: str, *extra: str):
    return load_config(None, ["rollout.group_size=2", "rollout.tasks_per_step=6", f"env.mix={mix}",
                              "env.num_eval_tasks=3", *extra])  # fmt: skip


def collect(renderer, cfg, step: int = 1):
    pool = SimpleNamespace(workers=[ScriptedWorker(renderer)])
    return collect_step(pool, cfg.env, cfg.rollout, cfg.algorithm, stages(cfg)[0], cfg.seed, step)


MIXED = f'{{"{CRASHING}": 1.0, Calculator: 1.0}}'


def test_a_raising_env_step_is_kept_with_its_traceback_and_the_users_line(renderer):
    c = collect(renderer, config(MIXED))
    failed = [e for e in c.episodes if e.status == EpisodeStatus.ERROR]
    assert len(c.episodes) == 12 and 0 < len(failed) <= 6, "pick a step whose tasks mix both envs"
    for e in failed:
        assert e.env_id == CRASHING and e.info["error_where"] == "env.step"
        assert e.status_detail == "env.step: ConnectionError: tool server unreachable"
        assert e.info["error_type"] == "ConnectionError"
        # the user's frame, not ours (rollout/episode.py) nor concurrent.futures where it was re-raised
        assert e.info["error_location"] == f"{rl_factories.__file__}:{RAISE_LINE} in step"
        assert e.info["error_code"].startswith('raise ConnectionError("tool server unreachable")')
        assert "Traceback (most recent call last)" in e.info["error_traceback"]
        assert 'raise ConnectionError("tool server unreachable")' in e.info["error_traceback"]
    m = c.metrics
    assert m["rollout/env_errors"] == len(failed) == m[f"rollout/env_errors/{CRASHING}"]
    assert m["rollout/env_errors/Calculator"] == 0
    for env in (CRASHING, "Calculator"):
        assert 0 <= m[f"reward/env/{env}/success_rate"] <= 1 and f"reward/env/{env}/mean" in m
    assert all(e.status != EpisodeStatus.ERROR for g in c.groups for e in g.episodes)  # out of the loss


def test_env_failures_go_to_errors_jsonl_and_each_kind_is_printed_once(renderer, tmp_path):
    cfg = config(MIXED)
    said: list[str] = []
    log = ErrorLog(tmp_path, said.append)
    step1, step2 = collect(renderer, cfg, 1), collect(renderer, cfg, 2)
    n1 = len(log.record(1, "train", step1.episodes))
    n2 = len(log.record(2, "train", step2.episodes))
    rows = read_errors(tmp_path / "errors.jsonl")
    assert n1 > 0 and n2 > 0 and len(rows) == n1 + n2
    ids = {e.episode_id: e for e in step1.episodes + step2.episodes}
    for r in rows:
        e = ids[r["episode_id"]]
        assert r["env"] == CRASHING and r["task"] == e.task_id and r["where"] == "env.step"
        assert r["step"] in (1, 2) and r["phase"] == "train"
        assert r["error"] == "ConnectionError: tool server unreachable"
        assert 'raise ConnectionError("tool server unreachable")' in r["traceback"]
    assert len(said) == 1, said  # one kind (same type, same line): printed once, at its first occurrence
    assert f"{rl_factories.__file__}:{RAISE_LINE} in step" in said[0] and "tool server unreachable" in said[0]
    assert str(tmp_path / "errors.jsonl") in said[0]
    resumed = ErrorLog(tmp_path, said.append)  # a resumed run remembers what it has shown
    resumed.record(3, "train", step1.episodes)
    assert len(said) == 1
    truncate_errors(tmp_path / "errors.jsonl", last_train=1, last_eval=0)  # what a resume redoes goes
    assert {r["step"] for r in read_errors(tmp_path / "errors.jsonl")} == {1}


def test_a_tool_that_raises_a_bug_is_recorded_and_the_episode_goes_on(renderer, tmp_path):
    from envs import protocol

    call = protocol.format_tool_call("calculator", {"expression": "1 + 1"})
    cfg = config('{"rl_factories:BuggyToolCalculator": 1.0}', "rollout.tasks_per_step=1", "rollout.max_turns=2")
    pool = SimpleNamespace(workers=[ScriptedWorker(renderer, answer=call)])
    c = collect_step(pool, cfg.env, cfg.rollout, cfg.algorithm, stages(cfg)[0], cfg.seed, 1)
    assert all(e.status == EpisodeStatus.TRUNCATED for e in c.episodes)  # not ERROR: the model saw the error
    assert c.metrics["rollout/tool_crashes/rl_factories:BuggyToolCalculator"] == 4  # 2 episodes x 2 turns
    assert "error: tool calculator failed: KeyError" in c.episodes[0].turns[0].observation[0]["content"]
    said: list[str] = []
    rows = ErrorLog(tmp_path, said.append).record(1, "train", c.episodes)
    line = next(i for i, text in enumerate(inspect.getsource(rl_factories).splitlines(), 1) if '["ops"][expression]' in text)
    assert len(rows) == 4 and {r.where for r in rows} == {"tool calculator"}
    assert all(r.location == f"{rl_factories.__file__}:{line} in calculator" for r in rows)
    assert all("KeyError" in r.traceback and r.task.startswith("BuggyToolCalculator/") for r in rows)
    assert len(said) == 1 and "tool calculator of env rl_factories:BuggyToolCalculator raised KeyError" in said[0]


def test_a_step_where_most_episodes_fail_in_the_env_stops_with_that_error(renderer):
    only = f'{{"{CRASHING}": 1.0}}'
    cfg = config(only, "rollout.tasks_per_step=4")
    with pytest.raises(EnvFailure) as e:  # step 1: 3 of its 4 tasks crash
        collect(renderer, cfg, 1)
    msg = str(e.value)
    assert "6 of 8 episodes of step 1 failed in the env" in msg and "max_env_error_fraction=0.5" in msg
    assert "ConnectionError: tool server unreachable" in msg and f"rl_factories.py:{RAISE_LINE}" in msg
    assert len(e.value.episodes) == 8  # every episode, for errors.jsonl
    assert collect(renderer, cfg, 2).metrics["rollout/env_errors"] == 4  # half is not most: goes on
    lenient = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_env_error_fraction=0.8))
    assert collect(renderer, lenient, 1).metrics["rollout/env_errors"] == 6


def test_an_eval_env_that_cannot_be_built_is_a_failed_evaluation_not_zero_success(renderer, tmp_path):
    from rl.train import finish

    cfg = config("{Calculator: 1.0}", "env.eval_env=rl_factories:UnbuildableCalculator", "run.plots=false")
    pool = SimpleNamespace(workers=[ScriptedWorker(renderer)])
    ev = run_evaluation(pool, cfg.env, cfg.rollout, stages(cfg)[0])
    assert "every one of the 3 evaluation episodes failed" in ev.failed and "test set not found" in ev.failed
    assert ev.metrics["eval/failed"] == 1.0 and "eval/success_rate" not in ev.metrics
    assert all(e.info["error_where"] == "env.make" for e in ev.episodes)
    said: list[str] = []
    assert len(ErrorLog(tmp_path, said.append).record(0, "eval", ev.episodes)) == 3 and len(said) == 1
    assert "env.make of env rl_factories:UnbuildableCalculator failed: FileNotFoundError" in said[0]
    rows = read_errors(tmp_path / "errors.jsonl")  # never reset, so no task id: the task's reset options
    assert [r["task"] for r in rows] == [f"split=test task_index={i}" for i in range(3)]
    ok = {"eval/success_rate": 0.5, "eval/mean": 0.5}
    summary = finish(cfg, tmp_path, ev.metrics, ok)
    assert summary["status"] == "eval_failed" and summary["exit_code"] == EXIT_EVAL_FAILED
    assert summary["held_out_success_before"] is None and summary["held_out_success_gain_points"] is None
    assert summary["held_out_success_after"] == 0.5 and "test set not found" in summary["eval_failures"]["before"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    text = summary_text(summary)
    assert "held_out_success_before" in text and "FAILED" in text and "eval_failed" in text
    fine = finish(cfg, tmp_path, ok, ok)
    assert fine["status"] == "ok" and fine["exit_code"] == 0 and fine["held_out_success_gain_points"] == 0.0


def test_transcripts_sample_errors_successes_and_failures(renderer, tmp_path):
    eps = [episode([turn([1], [2])], r, eid=f"e{i}") for i, r in enumerate([0.0, 1.0, 0.0, 0.0, 1.0, 0.0])]
    for e, solved in zip(eps, [False, True, False, False, True, False]):
        e.info["solved"] = solved
    eps[5].status = EpisodeStatus.ERROR
    for seed in range(5):
        picked = sample_episodes(eps, 3, seed)
        assert len(picked) == 3 and eps[5] in picked
        assert any(e.info["solved"] for e in picked) and any(not e.info["solved"] for e in picked[:2] + picked[3:])
    assert sample_episodes(eps, 0) == [] and len(sample_episodes(eps, 10)) == 6

    c = collect(renderer, config(MIXED))
    decode = lambda ids: renderer.tokenizer.decode(ids, skip_special_tokens=False)
    path = TranscriptWriter(tmp_path, 4, decode=decode).write(1, "train", c.episodes)
    assert path == tmp_path / "transcripts" / "step_000001.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and any(r["status"] == "error" for r in rows)
    by_id = {e.episode_id: e for e in c.episodes}
    for r in rows:
        e = by_id[r["episode_id"]]
        assert r["env"] == e.env_id and r["task_id"] == e.task_id and r["reward"] == e.reward
        assert r["sampled_tokens"] == e.num_sampled_tokens > 0 and r["num_turns"] == len(e.turns) == 1
        t = r["turns"][0]
        assert t["text"] == "<answer>0</answer>" and t["sampled_tokens"] == len(e.turns[0].token_ids)
        assert t["prompt_tokens"] == len(e.turns[0].prompt_token_ids)
        assert e.messages[1]["content"] in t["prompt_text"] and "<|im_start|>" in t["prompt_text"]
        assert r["opening_messages"] == e.messages[:2] and "reward_breakdown" in r
        if r["status"] == "error":
            assert "raise ConnectionError" in r["info"]["error_traceback"]
    assert TranscriptWriter(tmp_path, 0).write(2, "train", c.episodes) is None


def test_one_line_per_step_without_the_progress_bar(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), total_steps=3, tensorboard=False, progress=False, start_step=1)
    log.advance({"reward/mean": 0.25, "reward/success_rate": 0.5, "loss": 0.0123, "perf/step_s": 12.34})
    log.close()
    assert capsys.readouterr().out == "step 2/3  reward 0.25  success 50%  loss 0.0123  12.3s\n"


def test_kl_plot_is_the_reference_kl_and_mismatch_has_its_own(tmp_path):
    from rl.metrics import write_plots

    assert PLOTS["kl.png"] == [["kl_ref"]]
    assert {k for panel in PLOTS["mismatch.png"] for k in panel} == {"mismatch/kl", "mismatch/logprob_abs_mean"}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "mismatch/kl": 1e-8}) + "\n")
    assert {Path(p).name for p in write_plots(tmp_path)} == set(PLOTS)  # no kl_ref: the plot says so
