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


def test_prompt_routes_fill_the_prompt_positions_of_the_row():
    """Each turn's prompt records land on its prompt tokens, its sampled records on its sampled tokens;
    "none" rows (uint16 65535 or int16 -1) and turns without records stay -1."""
    none = np.iinfo(np.uint16).max
    r = lambda *ids: np.array([[[i, i + 1]] * 3 for i in ids])  # [n, 3 layers, top-2]
    sampled = r(40, 50)
    sampled[-1] = none  # the last sampled token: filled by the next turn (rollout/episode.py)
    first_prompt = r(10, 20, 30)
    first_prompt[0] = none  # e.g. a prefix-cache hit
    second = turn([6], [7], logprobs=[-0.3])
    second.prompt_routed_experts = r(60).astype(np.int16)  # the worker's int16 records say none with -1
    second.routed_experts = np.full((1, 3, 2), -1, dtype=np.int16)
    ep = episode([turn([1, 2, 3], [4, 5], routes=sampled, prompt_routes=first_prompt), second], 1.0)
    row = episode_row(ep, [0.5, -1.0])
    assert row.routed_experts[:, 0, 0].tolist() == [-1, 20, 30, 40, -1, 60, -1]
    assert row.routed_experts[5].tolist() == [[60, 61]] * 3
    bare = episode([turn([1, 2], [3], routes=r(30)), turn([4], [5], routes=r(50), prompt_routes=r(40))], 0.0)
    assert episode_row(bare, [0.0, 0.0]).routed_experts[:, 0, 0].tolist() == [-1, -1, 30, 40, 50]
    only_prompt = episode([turn([1, 2], [3], prompt_routes=r(10, 20))], 0.0)  # a record in the prompt alone
    assert episode_row(only_prompt, [0.0]).routed_experts[:, 0, 0].tolist() == [10, 20, -1]
    b = pack([row], "token_mean", 4)
    assert b.routed_experts_TLK[:, 0, 0].tolist() == [-1, 20, 30, 40, -1, 60, -1]


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
    assert b.routed_experts_TLK.dtype == torch.int32  # a quarter of int64 to check on the host and copy over
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
    mixed = episode(
        [turn([1], [2], routes=np.zeros((1, 3, 2))), turn([3], [4], prompt_routes=np.zeros((1, 2, 2)))], 0.0
    )
    with pytest.raises(ValueError, match=r"routed experts of shape \[1, 2, 2\]"):
        episode_row(mixed, [0.0, 0.0])
