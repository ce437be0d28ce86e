"""Packing episodes into varlen TrainBatches."""

import numpy as np
import pytest
import torch
from rl_factories import episode, turn

from envs.types import EpisodeGroup
from rl.batching import episode_row, minibatches, pack, rows_from_groups


def two_turn_episode(eid="a"):
    routes = np.arange(2 * 3 * 2).reshape(2, 3, 2)  # 2 sampled tokens, 3 MoE layers, top-2
    return episode(
        [turn([1, 2, 3], [4, 5], logprobs=[-0.1, -0.2], routes=routes), turn([6], [7], logprobs=[-0.3])],
        reward=1.0, eid=eid,
    )  # fmt: skip


def test_row_masks_only_sampled_tokens_and_broadcasts_turn_advantages():
    row = episode_row(two_turn_episode(), [0.5, -1.0])
    assert row.input_ids == [1, 2, 3, 4, 5, 6, 7]
    assert row.loss_mask == [False, False, False, True, True, False, True]
    assert row.advantages == [0, 0, 0, 0.5, 0.5, 0, -1.0]
    assert row.rollout_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, -0.3])
    assert row.value_positions == [2, 5]
    assert row.routed_experts[3].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert (row.routed_experts[:3] == -1).all() and (row.routed_experts[5:] == -1).all()


def test_episode_tokens_are_the_shared_record_token_view():
    ep = two_turn_episode()
    row = episode_row(ep, [0.0, 0.0])
    assert row.input_ids == ep.token_ids and row.loss_mask == ep.loss_mask
    assert row.rollout_logprobs == pytest.approx(ep.rollout_logprobs)


def test_pack_cu_seqlens_and_split_preserve_weights():
    eps = [two_turn_episode("a"), episode([turn([1], [2, 3, 4])], 0.0, eid="b"), two_turn_episode("c")]
    rows = rows_from_groups([EpisodeGroup("t", eps)], [[[1.0, 1.0], [2.0], [3.0, 3.0]]])
    b = pack(rows, "seq_mean_token_mean", 16)
    assert b.cu_seqlens_N1.tolist() == [0, 7, 11, 18]
    assert b.token_weights_T.sum().item() == pytest.approx(1.0)
    assert b.routed_experts_TLK.shape == (18, 3, 2) and (b.routed_experts_TLK[7:11] == -1).all()
    parts = b.split(12)
    assert [p.num_seqs for p in parts] == [2, 1]
    assert parts[1].cu_seqlens_N1.tolist() == [0, 7] and parts[1].seq_ids_T.tolist() == [0] * 7
    assert sum(p.token_weights_T.sum().item() for p in parts) == pytest.approx(1.0)
    assert torch.equal(torch.cat([p.input_ids_T for p in parts]), b.input_ids_T)
    assert parts[1].episode_ids == ["c"]


def test_sequence_longer_than_budget_gets_its_own_microbatch():
    rows = rows_from_groups([EpisodeGroup("t", [two_turn_episode()])], [[[1.0, 1.0]]])
    assert [p.num_tokens for p in pack(rows, "token_mean", 1).split(3)] == [7]


def test_minibatches_cover_every_episode_once():
    eps = [episode([turn([1], [2])], float(i), eid=str(i)) for i in range(5)]
    rows = rows_from_groups([EpisodeGroup("t", eps)], [[[0.0] for _ in eps]])
    mbs = minibatches(rows, 2, "token_mean", 16, 4, seed=1)
    ids = sorted(i for mb in mbs for micro in mb for i in micro.episode_ids)
    assert ids == [str(i) for i in range(5)]
    for mb in mbs:
        assert sum(m.token_weights_T.sum().item() for m in mb) == pytest.approx(1.0)


def test_bad_episodes_are_rejected_clearly():
    with pytest.raises(ValueError, match="advantages"):
        episode_row(two_turn_episode(), [1.0])
    with pytest.raises(ValueError, match="first token is sampled"):
        episode_row(episode([turn([], [1, 2])], 0.0), [0.0])
