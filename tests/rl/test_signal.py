"""The no-learning-signal detector (rl/signal.py): pure, on hand-built groups and metrics."""

import json

from rl_factories import group

from rl.metrics import summary_text
from rl.signal import NoSignalDetector, signal_metrics


def flat(rewards_per_group):
    return [group(rs, task=f"t{i}") for i, rs in enumerate(rewards_per_group)]


def test_signal_metrics_count_zero_variance_groups():
    m = signal_metrics(flat([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]]))
    assert m == {"signal/groups": 3.0, "signal/zero_variance_groups": 2.0, "signal/reward_range": 1.0}
    assert signal_metrics([])["signal/groups"] == 0.0


def test_warns_once_after_patience_steps_of_identical_group_rewards():
    d = NoSignalDetector(patience=3)
    dead = flat([[0.0, 0.0], [0.0, 0.0]])
    new = [d.observe_groups(s, dead, {"reward/success_rate": 0.0, "reward/mean": 0.0}) for s in (1, 2, 3, 4)]
    assert [len(w) for w in new] == [0, 0, 1, 0]  # once per streak, when it reaches the patience
    (msg,) = new[2]
    assert "every group had identical rewards for 3 consecutive steps (steps 1-3" in msg
    assert "never succeeds" in msg and "sft" in msg and "difficulty" in msg
    assert d.warnings == [msg] and "reward.functions" not in msg
    rubric_run = NoSignalDetector(patience=1).observe_groups(
        1, dead, {"reward/success_rate": 0.0, "reward/fn/f": 0.0}
    )
    assert "reward.functions" in rubric_run[0]  # with reward functions, they are a suspect too


def test_a_step_with_signal_resets_the_streak():
    d = NoSignalDetector(patience=2)
    dead, alive = flat([[1.0, 1.0]]), flat([[1.0, 0.0], [1.0, 1.0]])
    assert d.observe_groups(1, dead) == [] and d.observe_groups(2, alive) == []
    assert d.observe_groups(3, dead) == [] and d.observe_groups(4, alive) == [] and d.warnings == []
    warned = d.observe_groups(5, dead, {"reward/success_rate": 1.0}) + d.observe_groups(
        6, dead, {"reward/success_rate": 1.0}
    )
    assert len(warned) == 1 and "steps 5-6" in warned[0] and "always succeeds" in warned[0]


def test_mixed_success_with_identical_rewards_points_at_the_reward_functions():
    d = NoSignalDetector(patience=1)
    (msg,) = d.observe_groups(1, flat([[0.25] * 4, [0.25] * 4]), {"reward/success_rate": 0.5})
    assert "reward functions" in msg and "reward.functions" in msg


def test_batch_baselines_only_warn_when_every_reward_is_equal():
    d = NoSignalDetector(patience=1, grouped=False)
    assert d.observe_groups(1, flat([[1.0, 1.0], [0.0, 0.0]])) == []  # REINFORCE++ learns across groups
    (msg,) = d.observe_groups(2, flat([[1.0, 1.0], [1.0, 1.0]]))
    assert "every episode had the same reward" in msg


def test_zero_patience_and_missing_metrics_never_warn():
    assert NoSignalDetector(patience=0).observe_groups(1, flat([[0.0, 0.0]])) == []
    assert NoSignalDetector(patience=1).observe(1, {"reward/mean": 0.0}) == []  # nothing to judge


def test_held_out_success_of_zero_before_rl_is_a_warning():
    d = NoSignalDetector()
    (msg,) = d.observe_eval_before({"eval/success_rate": 0.0})
    assert "held-out success is 0% before RL" in msg and "sft" in msg
    assert d.observe_eval_before({"eval/success_rate": 0.4}) == []
    assert "100%" in d.observe_eval_before({"eval/success_rate": 1.0})[0]
    assert len(d.warnings) == 2
    (cut,) = NoSignalDetector().observe_eval_before({"eval/success_rate": 0.0, "eval/truncated": 1.0})
    assert "100% of the held-out episodes were cut by a budget" in cut and "episode_timeout_s" in cut


def test_state_round_trips_for_resumes_and_summary_lists_the_warnings():
    d = NoSignalDetector(patience=3)
    dead = flat([[0.0, 0.0]])
    d.observe_eval_before({"eval/success_rate": 0.0})
    d.observe_groups(1, dead)
    d.observe_groups(2, dead)
    resumed = NoSignalDetector.from_state(json.loads(json.dumps(d.state_dict())), patience=3, grouped=True)
    assert resumed.observe_groups(3, dead)  # the streak went on across the resume
    assert len(resumed.warnings) == 2
    text = summary_text({"warnings": resumed.warnings, "held_out_success_after": 0.5})
    assert "warnings" in text and all(f"  - {w}" in text for w in resumed.warnings)
    assert "none" in summary_text({"warnings": []})
