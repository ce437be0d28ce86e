"""Driver pieces without Ray: expert episodes, task sampling, error filtering, checkpoints, metrics, NIAH."""

import json
from pathlib import Path

import pytest
from rl_factories import episode, group, turn

from envs.types import EpisodeGroup, EpisodeStatus
from rl import checkpoint
from rl.config import load_config, stages
from rl.metrics import MetricsLogger, read_metrics, truncate_metrics, write_plots
from rl.rollouts import drop_env_errors, episode_metrics, eval_tasks, train_tasks


@pytest.fixture(scope="module")
def renderer():
    from rollout.renderer import ChatRenderer

    return ChatRenderer()


def test_expert_episode_matches_the_rollout_token_layout(renderer):
    import envs
    from rl.sft import expert_episode

    env = envs.make("Calculator", difficulty=2)
    ep = expert_episode(env, renderer, {"split": "train", "task_index": 5}, "Calculator")
    assert ep.info["solved"] and ep.reward == 1.0 and len(ep.turns) == 3
    first = ep.turns[0]
    assert first.prompt_token_ids == renderer.render(ep.messages, ep.tools, add_generation_prompt=True)
    assert first.token_ids[-1] == renderer.tool_call_end_id  # the engine stops on </tool_call>
    assert ep.turns[-1].token_ids[-1] == renderer.im_end_id  # ... or on <|im_end|>
    for prev, nxt in zip(ep.turns, ep.turns[1:]):  # token-in-token-out continuation, never re-tokenised
        assert nxt.prompt_token_ids == renderer.continuation_ids(prev.token_ids, prev.observation)
    assert renderer.assistant_text(ep.turns[0].token_ids) == ep.turns[0].text


def test_sft_batches_put_loss_on_assistant_tokens_only(renderer):
    from rl.config import SFTConfig
    from rl.sft import expert_episodes, sft_batches

    eps = expert_episodes(SFTConfig(num_episodes=3), {}, renderer)
    (batch,) = next(sft_batches(eps, 3, 100_000, seed=0))
    assert batch.num_seqs == 3
    assert int(batch.loss_mask_T.sum()) == sum(e.num_sampled_tokens for e in eps)
    assert batch.token_weights_T.sum().item() == pytest.approx(1.0)


def test_train_tasks_are_a_function_of_seed_and_step():
    cfg = load_config(None, ["env.mix={Calculator: 1.0, Countdown: 1.0}"])
    stage = stages(cfg)[0]
    a = train_tasks(cfg.env, stage, 0, 3)
    assert [t.options for t in a] == [t.options for t in train_tasks(cfg.env, stage, 0, 3)]
    assert [t.options for t in a] != [t.options for t in train_tasks(cfg.env, stage, 0, 4)]
    assert {t.env for t in a} <= {"Calculator", "Countdown"} and all(t.options["split"] == "train" for t in a)
    ev = eval_tasks(cfg.env, stage)
    assert len(ev) == cfg.env.num_eval_tasks and all(t.options["split"] == "test" for t in ev)


def test_env_errors_are_removed_and_counted():
    g = group([1.0, 0.0, 1.0])
    g.episodes[1].status, g.episodes[1].status_detail = EpisodeStatus.ERROR, "env.step: boom"
    kept, errors, msg = drop_env_errors([g], min_size=2)
    assert errors == 1 and msg == "env.step: boom" and len(kept[0].episodes) == 2
    kept, errors, _ = drop_env_errors([g], min_size=3)
    assert kept == [] and errors == 1
    m = episode_metrics([g])
    assert m["reward/errors"] == pytest.approx(1 / 3) and m["reward/mean"] == pytest.approx(2 / 3)


def test_busy_fractions_count_the_work_inside_the_steps_own_window():
    from rl.steps import busy_fractions

    step = {
        f"perf/{k}": v for k, v in {"rollout_s": 3.0, "train_s": 2.0, "eval_s": 1.0, "step_s": 10.0}.items()
    }
    nxt = {"perf/rollout_s": 4.0}
    # its groups came from the previous step: this window holds the next step's collection and the eval
    assert busy_fractions(step, False, nxt) == {"perf/rollout_busy_frac": 0.5, "perf/learner_busy_frac": 0.2}
    # the first step collected its own groups too; the last collects none
    assert busy_fractions(step, True, nxt)["perf/rollout_busy_frac"] == 0.8
    assert busy_fractions({**step, "perf/eval_s": 0.0}, False, {})["perf/rollout_busy_frac"] == 0.0
    assert busy_fractions({"perf/step_s": 0.0}, True, nxt) == {}


def test_checkpoint_roundtrip_keeps_in_flight_groups_and_prunes(tmp_path):
    eg = EpisodeGroup("t", [episode([turn([1], [2])], 1.0)])
    for step in (1, 2, 3):
        state = checkpoint.RunState(step=step, in_flight=[eg], eval_before={"eval/success_rate": 0.25})
        checkpoint.save(tmp_path, state, lambda p: Path(p).write_text("learner"), keep=2)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step_000002", "step_000003"]
    latest = checkpoint.latest(tmp_path)
    restored = checkpoint.load(latest)
    assert restored.step == 3 and restored.in_flight[0].episodes[0].token_ids == [1, 2]
    (tmp_path / "checkpoints" / "step_000004.tmp").mkdir()  # a crash mid-save is never "latest"
    assert checkpoint.latest(tmp_path) == latest


def test_metrics_jsonl_truncation_and_plots(tmp_path):
    log = MetricsLogger(str(tmp_path), total_steps=3, tensorboard=True, progress=False)
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": step / 10, "mismatch/logprob_abs_mean": 1e-7, "kl_ref": 0.01})
    log.close()
    truncate_metrics(tmp_path / "metrics.jsonl", 2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    files = write_plots(tmp_path)
    assert len(files) == 4 and all((tmp_path / f.split("/")[-1]).stat().st_size > 0 for f in files)
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["reward/mean"] == 0.1


def test_niah_episodes_fit_their_length(renderer):
    from rl.niah import niah_episodes

    eps = niah_episodes(400, 2, renderer)
    assert len(eps) == 2 and all(len(e.token_ids) <= 400 for e in eps) and all(e.info["solved"] for e in eps)


def test_sft_entry_point_writes_a_checkpoint_rl_can_load(tmp_path):
    from rl.config import CONFIGS_ROOT
    from rl.sft import main

    out = tmp_path / "sft"
    cfg = str(CONFIGS_ROOT / "exp" / "ci_tiny.yaml")
    assert main(["--config", cfg, "sft.num_episodes=4", "sft.batch_episodes=2", "sft.max_steps=1",
                 f"sft.output_dir={out}"]) == 0  # fmt: skip
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert load_config(cfg, [f"model.init_from={out}"]).model.init_from == str(out)


def test_episode_ids_are_unique_across_steps_evaluation_and_a_resume(renderer, tmp_path):
    """Real episode loop, manager and driver collection on a plain scripted worker (no engine)."""
    from types import SimpleNamespace

    from rl_factories import ScriptedWorker

    from rl.rollouts import collect_step, evaluate

    cfg = load_config(None, ["rollout.group_size=2", "rollout.tasks_per_step=3", "env.num_eval_tasks=2"])
    stage = stages(cfg)[0]
    worker = ScriptedWorker(renderer)
    pool = SimpleNamespace(workers=[worker])

    def collect(step):
        return collect_step(pool, cfg.env, cfg.rollout, cfg.algorithm, stage, cfg.seed, step).groups

    step1, step2 = collect(1), collect(2)
    evaluate(pool, cfg.env, cfg.rollout, stage)
    checkpoint.save(
        tmp_path, checkpoint.RunState(step=1, in_flight=step2), lambda p: Path(p).write_text(""), 2
    )
    in_flight = checkpoint.load(checkpoint.latest(tmp_path)).in_flight  # a resumed run trains on these ...
    again, step3 = collect(2), collect(3)  # ... and collects on from there (here: step 2 once more, too)
    trained = [
        e.episode_id for groups in (step1, in_flight, again, step3) for g in groups for e in g.episodes
    ]
    assert len(set(trained)) == len(trained) == 4 * 6
    assert len(set(worker.served)) == len(trained) + 2  # + the two evaluation episodes; one turn each
    assert worker.reopened == []  # no session id came back after it was ended
    # the ids are all that differs: the same step gives the same tasks, seeds and episodes
    assert [e.messages for g in again for e in g.episodes] == [e.messages for g in step2 for e in g.episodes]
