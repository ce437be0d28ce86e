"""Credit assignment against hand-computed values."""

import math

import pytest
from rl_factories import episode, group, turn

from envs.types import EpisodeGroup
from rl.advantages import compute_advantages, discounted_returns, gae, keep_group, turn_rewards
from rl.config import AlgorithmConfig


def cfg(name="grpo", **kw) -> AlgorithmConfig:
    return AlgorithmConfig(name=name, **kw).resolved()


def test_grpo_group_zscore():
    adv, targets = compute_advantages([group([1.0, 0.0, 0.0, 1.0])], cfg("grpo", adv_eps=0.0))
    # mean 0.5, population std 0.5
    assert [a[0] for a in adv[0]] == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert targets is None


def test_dr_grpo_no_std():
    adv, _ = compute_advantages([group([3.0, 1.0])], cfg("dr_grpo"))
    assert [a[0] for a in adv[0]] == pytest.approx([1.0, -1.0])


def test_rloo_leave_one_out():
    adv, _ = compute_advantages([group([1.0, 0.0, 0.0])], cfg("rloo"))
    assert [a[0] for a in adv[0]] == pytest.approx([1.0, -0.5, -0.5])


def test_reinforce_pp_batch_baseline_and_std():
    adv, _ = compute_advantages([group([1.0, 0.0]), group([1.0, 1.0])], cfg("reinforce_pp", adv_eps=0.0))
    # batch mean 0.75, centred [0.25,-0.75,0.25,0.25], std = sqrt(0.1875)
    s = math.sqrt(0.1875)
    flat = [a[0] for g in adv for a in g]
    assert flat == pytest.approx([0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s])


def _lengths(g, ns):
    for ep, n in zip(g.episodes, ns):
        ep.turns = [turn([1], [7] * n)]
    return g


def test_reinforce_pp_whitening_is_token_weighted():
    """Unequal episode lengths: the batch mean and std are those of the batch's tokens."""
    groups = [_lengths(group([1.0, 0.0]), [1, 5]), _lengths(group([2.0, 0.5, 1.0]), [3, 2, 8])]
    adv, _ = compute_advantages(groups, cfg("reinforce_pp", adv_eps=0.0))
    tokens = [(ep.reward, len(ep.turns[0].token_ids)) for g in groups for ep in g.episodes]
    per_token = [r for r, n in tokens for _ in range(n)]  # every sampled token carries its episode's return
    m = sum(per_token) / len(per_token)
    s = math.sqrt(sum((x - m) ** 2 for x in per_token) / len(per_token))
    assert [a[0] for g in adv for a in g] == pytest.approx([(r - m) / s for r, _ in tokens])
    token_adv = [
        a[0] for g, ga in zip(groups, adv) for ep, a in zip(g.episodes, ga) for _ in ep.turns[0].token_ids
    ]
    assert sum(token_adv) / len(token_adv) == pytest.approx(0.0, abs=1e-12)  # whitened over tokens
    assert math.sqrt(sum(x * x for x in token_adv) / len(token_adv)) == pytest.approx(1.0)
    per_episode = sum(r for r, _ in tokens) / len(tokens)
    assert abs(per_episode - m) > 0.05  # the lengths matter here: an episode-weighted mean would differ


def test_reinforce_pp_turn_credit_keeps_episode_return_statistics():
    long_answer = episode([turn([1], [7], reward=0.5), turn([2], [7] * 3)], 1.0)  # 4 tokens, G_0 = 1
    wrong = episode([turn([1], [7] * 12)], 0.0)  # 12 tokens, G_0 = 0
    adv, _ = compute_advantages([EpisodeGroup("t", [long_answer, wrong])],
                                cfg("reinforce_pp", credit="turn", adv_eps=0.0))  # fmt: skip
    # b = (4 * 1 + 12 * 0) / 16; s^2 = (4 * 0.75^2 + 12 * 0.25^2) / 16; turn returns [1.0, 0.5] and [0.0]
    b, s = 0.25, math.sqrt(0.1875)
    assert adv[0][0] == pytest.approx([(1.0 - b) / s, (0.5 - b) / s]) and adv[0][1] == pytest.approx([-b / s])


def test_equal_rewards_give_zero_and_are_dropped_by_dynamic_sampling():
    g = group([1.0, 1.0, 1.0])
    adv, _ = compute_advantages([g], cfg("grpo"))
    assert all(a[0] == 0.0 for a in adv[0])
    assert not keep_group(g) and keep_group(group([1.0, 0.0]))


def test_outcome_broadcast_to_every_turn():
    adv, _ = compute_advantages([group([1.0, 0.0], turns_per_ep=3)], cfg("dr_grpo"))
    assert adv[0] == [[0.5, 0.5, 0.5], [-0.5, -0.5, -0.5]]


def test_turn_rewards_put_rubric_remainder_on_last_turn():
    ep = episode([turn([1], [2], reward=0.1), turn([3], [4], reward=0.2)], reward=1.0)
    assert turn_rewards(ep) == pytest.approx([0.1, 0.9])


def test_discounted_returns():
    assert discounted_returns([0.1, 0.0, 1.0], 0.5) == pytest.approx([0.35, 0.5, 1.0])


def test_turn_credit_discounts_and_uses_episode_return_baseline():
    e1 = episode([turn([1], [2], reward=0.0), turn([3], [4], reward=0.0)], reward=1.0, eid="a")
    e2 = episode([turn([1], [2]), turn([3], [4])], reward=0.0, eid="b")
    from envs.types import EpisodeGroup

    adv, _ = compute_advantages([EpisodeGroup("t", [e1, e2])], cfg("dr_grpo", credit="turn", gamma=0.5))
    # G(e1) = [0.5, 1.0], G(e2) = [0, 0]; baseline = mean of G_0 = 0.25
    assert adv[0] == [pytest.approx([0.25, 0.75]), pytest.approx([-0.25, -0.25])]


def test_turn_credit_gamma_one_equals_outcome():
    g = group([1.0, 0.0, 0.5], turns_per_ep=3)
    a_turn, _ = compute_advantages([g], cfg("grpo", credit="turn", gamma=1.0))
    a_out, _ = compute_advantages([g], cfg("grpo"))
    assert a_turn == a_out


def test_gae_hand_computed():
    adv, tgt = gae([0.0, 1.0], [0.5, 0.8], gamma=1.0, lam=1.0)
    assert adv == pytest.approx([0.5, 0.2]) and tgt == pytest.approx([1.0, 1.0])
    adv, _ = gae([0.0, 1.0], [0.5, 0.8], gamma=0.9, lam=0.5)
    # delta1 = 0.2, delta0 = 0.9*0.8 - 0.5 = 0.22, A0 = 0.22 + 0.45*0.2
    assert adv == pytest.approx([0.31, 0.2])


def test_ppo_gae_uses_values_and_needs_them():
    g = group([1.0], turns_per_ep=2)
    c = cfg("ppo", credit="gae", std_norm="none", lam=1.0)
    with pytest.raises(ValueError, match="value"):
        compute_advantages([g], c)
    adv, tgt = compute_advantages([g], c, values=[[[0.5, 0.8]]])
    assert adv[0][0] == pytest.approx([0.5, 0.2]) and tgt[0][0] == pytest.approx([1.0, 1.0])
