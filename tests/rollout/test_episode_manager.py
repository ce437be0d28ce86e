"""The episode loop and the manager against real envs and a real engine (tiny random model)."""

from __future__ import annotations

import time

import gymnasium
import pytest

from envs.types import EpisodeStatus
from rollout.episode import EpisodeBudget, EpisodeRun, SamplingConfig, drive_episodes, run_episode
from rollout.manager import RolloutManager, TaskSpec
from rollout.renderer import ChatRenderer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer()


def _calculator():
    from envs.registry import make

    return make("Calculator")


def check_token_view(ep, renderer):
    """Turn prompts are exactly the renderer's ids: the opening render, then continuations."""
    first = renderer.render(ep.messages[: len(ep.messages) - _tail(ep)], ep.tools, add_generation_prompt=True)
    assert ep.turns[0].prompt_token_ids == first
    for prev, turn in zip(ep.turns, ep.turns[1:]):
        assert turn.prompt_token_ids == renderer.continuation_ids(prev.token_ids, prev.observation)
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.rollout_logprobs)
    assert sum(ep.loss_mask) == ep.num_sampled_tokens
    for t in ep.turns:
        assert len(t.logprobs) == len(t.token_ids) > 0 and t.policy_version == 0
        assert t.routed_experts is not None and t.routed_experts.shape[0] == len(t.token_ids)
        # a session engine computes every new prompt id of a turn (resident or not): each has its routes
        p = t.prompt_routed_experts
        assert p is not None and p.shape[0] == len(t.prompt_token_ids) and (p >= 0).all()


def _tail(ep) -> int:
    """Messages appended after the opening ones (assistant turns + observations)."""
    return sum(1 + len(t.observation) for t in ep.turns)


def test_run_episode_records_a_consistent_token_view(session_worker, renderer):
    budget = EpisodeBudget(max_turns=3, max_tokens_per_turn=24, max_episode_tokens=700)
    ep = run_episode(
        _calculator(),
        session_worker,
        renderer,
        budget,
        SamplingConfig(temperature=1.0),
        reset_options={"task_index": 0},
    )
    assert ep.status in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED), ep.status_detail
    assert 1 <= len(ep.turns) <= 3 and ep.task_id.startswith("Calculator/")
    check_token_view(ep, renderer)
    if ep.status == EpisodeStatus.TRUNCATED:
        assert ep.status_detail in ("max_turns", "max_tokens", "env_truncated", "context")
    assert session_worker.load()["resident"] == 0  # finished episodes release their engine state
    # turns after the first prefilled only their new tokens (+ the carried sampled token)
    for t in ep.turns[1:]:
        assert t.num_computed_prompt_tokens == len(t.prompt_token_ids) + 1


def test_budgets_end_episodes_as_truncated(session_worker, renderer):
    one_turn = run_episode(
        _calculator(),
        session_worker,
        renderer,
        EpisodeBudget(max_turns=1, max_tokens_per_turn=8),
        reset_options={"task_index": 1},
    )
    assert len(one_turn.turns) == 1
    assert one_turn.status == EpisodeStatus.COMPLETED or one_turn.status_detail in (
        "max_turns",
        "env_truncated",
    )
    timed_out = run_episode(_calculator(), session_worker, renderer, EpisodeBudget(max_wall_s=0.0))
    assert timed_out.status == EpisodeStatus.TRUNCATED and timed_out.status_detail == "timeout"
    assert timed_out.turns == []


class EndlessEnv(gymnasium.Env):
    """Answers every turn with one more user message and never ends; each step takes ``step_s``."""

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s

    def reset(self, *, seed=None, options=None):
        return {"messages": [{"role": "user", "content": "hi"}], "tools": []}, {"task_id": "endless/0"}

    def step(self, action):
        time.sleep(self.step_s)
        return {"messages": [{"role": "user", "content": "go on"}]}, 0.0, False, False, {}


def test_the_timeout_counts_the_episodes_own_work_not_the_engine_wait(session_worker, renderer):
    """A loaded machine makes every turn of a big batch slow; that alone must not time episodes out."""
    budget, greedy = EpisodeBudget(max_turns=3, max_tokens_per_turn=8, max_wall_s=0.3), SamplingConfig(0.0)

    def slow_engine(requests):
        time.sleep(0.4)
        return session_worker.generate(requests)

    run = EpisodeRun(EndlessEnv(), renderer, budget, greedy)
    waited = drive_episodes([run], slow_engine, session_worker.end_sessions)[0]
    assert (waited.status_detail, len(waited.turns)) == ("max_turns", 3)
    assert run.engine_wait_s >= 1.2 and waited.wall_time_s >= 1.2
    slow = run_episode(EndlessEnv(step_s=0.4), session_worker, renderer, budget, greedy)
    assert (slow.status, slow.status_detail, len(slow.turns)) == (EpisodeStatus.TRUNCATED, "timeout", 1)


class ExplodingEnv(gymnasium.Env):
    """Resets fine, then its tool machinery crashes."""

    def reset(self, *, seed=None, options=None):
        return {"messages": [{"role": "user", "content": "hi"}], "tools": []}, {"task_id": "boom/0"}

    def step(self, action):
        raise RuntimeError("tool server down")


def test_a_failing_env_gives_an_error_episode_and_spares_the_others(session_worker, renderer):
    budget, sampling = EpisodeBudget(max_turns=2, max_tokens_per_turn=8), SamplingConfig()
    runs = [
        EpisodeRun(ExplodingEnv(), renderer, budget, sampling, episode_id="boom"),
        EpisodeRun(
            _calculator(), renderer, budget, sampling, episode_id="fine", reset_options={"task_index": 2}
        ),
    ]
    boom, fine = drive_episodes(runs, session_worker.generate, session_worker.end_sessions)
    assert boom.status == EpisodeStatus.ERROR and "tool server down" in boom.status_detail
    assert len(boom.turns) == 1  # the sampled turn is kept for inspection
    assert fine.status in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED)


def test_manager_collects_groups_and_scores_them(session_worker, renderer):
    from rewards.base import Rubric

    rubric = Rubric([("env", lambda ep: ep.env_reward, 1.0)], truncated_reward=None)
    mgr = RolloutManager(
        [session_worker],
        EpisodeBudget(max_turns=2, max_tokens_per_turn=16),
        SamplingConfig(),
        renderer,
        rubric=rubric,
    )
    tasks = [TaskSpec("Calculator", {"task_index": i}) for i in range(2)] + [TaskSpec("NoSuchEnv")]
    groups = mgr.collect(tasks, group_size=2)
    assert [len(g.episodes) for g in groups] == [2, 2, 2]
    for g in groups[:2]:
        assert len({e.episode_id for e in g.episodes}) == 2 and g.task_id.startswith("Calculator/")
        for ep in g.episodes:
            assert ep.status != EpisodeStatus.ERROR, ep.status_detail
            assert ep.reward_breakdown == {"env": ep.env_reward}
            check_token_view(ep, renderer)
    assert all(e.status == EpisodeStatus.ERROR and "env.make" in e.status_detail for e in groups[2].episodes)
    assert session_worker.load()["resident"] == 0


class SlowToolEnv(gymnasium.Env):
    """Every step takes ``delay`` seconds (a slow tool); the episode never ends on its own."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def reset(self, *, seed=None, options=None):
        return {"messages": [{"role": "user", "content": "wait"}], "tools": []}, {
            "task_id": f"slow/{self.delay}"
        }

    def step(self, action):
        import time

        time.sleep(self.delay)
        return {"messages": [{"role": "tool", "content": "ok"}], "tools": []}, 0.0, False, False, {}


def test_an_episode_waiting_on_a_slow_tool_does_not_hold_up_the_others(session_worker, renderer):
    budget, sampling = EpisodeBudget(max_turns=4, max_tokens_per_turn=4), SamplingConfig(temperature=0.0)
    runs = [
        EpisodeRun(SlowToolEnv(1.5), renderer, budget, sampling, episode_id="slow"),
        EpisodeRun(SlowToolEnv(0.0), renderer, budget, sampling, episode_id="fast"),
    ]
    batches = []

    def generate(reqs):  # the real worker, with the batch composition written down
        batches.append(sorted(r.session_id for r in reqs))
        return session_worker.generate(reqs)

    slow, fast = drive_episodes(runs, generate, session_worker.end_sessions)
    assert len(slow.turns) == len(fast.turns) == 4
    assert batches[0] == ["fast", "slow"]
    assert batches[1:4] == [["fast"]] * 3  # the fast episode finished while the slow tool was running
