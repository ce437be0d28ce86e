"""EpisodeGroups + per-turn advantages -> packed varlen TrainBatches (mini-batches of micro-batches).

The token stream of an episode is exactly ``Episode.token_ids`` (turn prompts and sampled tokens in
order, never re-tokenised). Advantages are broadcast from each turn to its sampled tokens; prompt,
template, tool and env tokens get loss_mask False and weight 0. Loss aggregation weights are
computed once per optimizer step (mini-batch) before it is cut into micro-batches, so gradient
accumulation reproduces the full mini-batch gradient exactly.

Routing replay: ``routed_experts_TLK`` lays each turn's engine records over its tokens, prompt
(``Turn.prompt_routed_experts``) and sampled (``Turn.routed_experts``) alike, so the learner replays
the experts of every token the engine computed; -1 where it computed none (rl/types.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from envs.types import Episode, EpisodeGroup
from rl.losses import token_weights
from rl.types import TrainBatch


@dataclass
class EpisodeRow:
    """One episode flattened to tokens (Python lists; packed into tensors by ``pack``)."""

    episode_id: str
    input_ids: list[int]  # [T_i]
    loss_mask: list[bool]  # [T_i]
    advantages: list[float]  # [T_i]
    rollout_logprobs: list[float]  # [T_i]
    value_positions: list[int]  # [num_turns] index of the token before each turn's first sampled token
    value_targets: list[float]  # [num_turns]
    routed_experts: np.ndarray | None  # [T_i, L, K] int32, -1 where the engine recorded none


def _routes(ep: Episode, length: int) -> np.ndarray | None:
    """[T, L, K] int32: each token's engine-recorded experts (its turn's ``prompt_routed_experts`` or
    ``routed_experts``), -1 where the engine recorded none (a prefix-cache hit, the episode's last
    sampled token, a turn without records); None when no turn has any record."""
    recorded = [
        r
        for t in ep.turns
        for r, n in ((t.prompt_routed_experts, len(t.prompt_token_ids)), (t.routed_experts, len(t.token_ids)))
        if r is not None and n
    ]
    if not recorded:
        return None
    _, num_layers, top_k = recorded[0].shape
    out = np.full((length, num_layers, top_k), -1, dtype=np.int32)
    pos = 0
    for t in ep.turns:
        for ids, routes in ((t.prompt_token_ids, t.prompt_routed_experts), (t.token_ids, t.routed_experts)):
            if routes is not None:
                _place(out, pos, routes, len(ids), ep.episode_id)
            pos += len(ids)
    return out


def _place(out: np.ndarray, pos: int, routes: np.ndarray, n: int, episode_id: str) -> None:
    """Copy one turn part's records into out[pos:pos + n] (uint16 records: 65535 = none, as -1)."""
    if routes.ndim != 3 or routes.shape[1:] != out.shape[1:]:
        raise ValueError(
            f"episode {episode_id}: routed experts of shape {list(routes.shape)}, want [n, L, K] with "
            f"[L, K] = {list(out.shape[1:])} as in its other turns"
        )
    m = min(n, routes.shape[0])
    r = routes[:m].astype(np.int32)
    out[pos : pos + m] = np.where(r >= np.iinfo(np.uint16).max, -1, r)


def episode_row(ep: Episode, turn_adv: list[float], turn_targets: list[float] | None = None) -> EpisodeRow:
    if len(turn_adv) != len(ep.turns):
        raise ValueError(f"episode {ep.episode_id}: {len(turn_adv)} advantages for {len(ep.turns)} turns")
    ids, mask, adv, lps, vpos = [], [], [], [], []
    for t, a in zip(ep.turns, turn_adv):
        if len(t.logprobs) != len(t.token_ids):
            raise ValueError(
                f"episode {ep.episode_id}: turn has {len(t.token_ids)} tokens, {len(t.logprobs)} logprobs"
            )
        ids += t.prompt_token_ids
        mask += [False] * len(t.prompt_token_ids)
        adv += [0.0] * len(t.prompt_token_ids)
        lps += [0.0] * len(t.prompt_token_ids)
        vpos.append(len(ids) - 1)  # the last token seen before sampling this turn
        ids += t.token_ids
        mask += [True] * len(t.token_ids)
        adv += [float(a)] * len(t.token_ids)
        lps += [float(x) for x in t.logprobs]
    if mask and mask[0]:
        raise ValueError(
            f"episode {ep.episode_id}: the first token is sampled; a turn needs a prompt before it"
        )
    targets = list(turn_targets) if turn_targets is not None else [0.0] * len(vpos)
    return EpisodeRow(ep.episode_id, ids, mask, adv, lps, vpos, targets, _routes(ep, len(ids)))


def rows_from_groups(groups: list[EpisodeGroup], advantages, value_targets=None) -> list[EpisodeRow]:
    """Flatten [group][episode] to rows; episodes without any token are dropped (nothing to learn from)."""
    rows = []
    for gi, g in enumerate(groups):
        for ei, ep in enumerate(g.episodes):
            targets = value_targets[gi][ei] if value_targets is not None else None
            row = episode_row(ep, advantages[gi][ei], targets)
            if row.input_ids:
                rows.append(row)
    return rows


def pack(rows: list[EpisodeRow], loss_agg: str, norm_tokens: int) -> TrainBatch:
    """Pack rows into one TrainBatch whose loss weights normalise over exactly these rows."""
    if not rows:
        raise ValueError("cannot pack an empty list of episodes")
    lengths = [len(r.input_ids) for r in rows]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cat = lambda key, dtype: torch.tensor([x for r in rows for x in getattr(r, key)], dtype=dtype)
    mask_T = cat("loss_mask", torch.bool)
    seq_ids_T = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    value_mask_T = torch.zeros(int(cu[-1]), dtype=torch.bool)
    value_targets_T = torch.zeros(int(cu[-1]), dtype=torch.float32)
    for start, r in zip(cu[:-1].tolist(), rows):
        pos = torch.tensor(r.value_positions, dtype=torch.long) + start
        value_mask_T[pos] = True
        value_targets_T[pos] = torch.tensor(r.value_targets, dtype=torch.float32)
    routes = None
    if any(r.routed_experts is not None for r in rows):
        shape = next(r.routed_experts.shape[1:] for r in rows if r.routed_experts is not None)
        free = lambda r: np.full((len(r.input_ids), *shape), -1, dtype=np.int32)
        routes = torch.from_numpy(np.concatenate([
            (r.routed_experts if r.routed_experts is not None else free(r)).astype(np.int32, copy=False) for r in rows
        ]))  # fmt: skip
    return TrainBatch(
        input_ids_T=cat("input_ids", torch.long),
        cu_seqlens_N1=cu,
        loss_mask_T=mask_T,
        advantages_T=cat("advantages", torch.float32),
        rollout_logprobs_T=cat("rollout_logprobs", torch.float32),
        token_weights_T=token_weights(mask_T, seq_ids_T, loss_agg, norm_tokens),
        seq_ids_T=seq_ids_T,
        value_mask_T=value_mask_T,
        value_targets_T=value_targets_T,
        value_weights_T=value_mask_T.float() / value_mask_T.sum().clamp_min(1),
        routed_experts_TLK=routes,
        episode_ids=[r.episode_id for r in rows],
    )


def minibatches(
    rows: list[EpisodeRow], num_minibatches: int, loss_agg: str, norm_tokens: int, micro_batch_tokens: int,
    seed: int = 0,
) -> list[list[TrainBatch]]:  # fmt: skip
    """Shuffle rows into ``num_minibatches`` optimizer steps, each a list of micro-batches."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n = max(1, min(num_minibatches, len(rows)))
    chunks = [order[i::n] for i in range(n)]
    return [
        pack([rows[i] for i in sorted(c)], loss_agg, norm_tokens).split(micro_batch_tokens) for c in chunks
    ]


def train_minibatches(groups: list[EpisodeGroup], algo, micro_batch_tokens: int, seed: int, values_fn=None):
    """Advantages (value-head values through ``values_fn`` when the algorithm uses them) -> minibatches.

    ``values_fn(batch) -> list[list[float]]`` gives the value at each turn boundary per sequence.
    """
    from rl.advantages import compute_advantages

    values = None
    if algo.baseline == "value" or algo.credit == "gae":
        flat = [ep for g in groups for ep in g.episodes]
        zero_rows = [episode_row(ep, [0.0] * len(ep.turns)) for ep in flat]
        per_seq = iter(values_fn(pack([r for r in zero_rows if r.input_ids], "token_mean", 1)))
        by_ep = [next(per_seq) if r.input_ids else [] for r in zero_rows]
        it = iter(by_ep)
        values = [[next(it) for _ in g.episodes] for g in groups]
    adv, targets = compute_advantages(groups, algo, values)
    rows = rows_from_groups(groups, adv, targets)
    if not rows:
        raise ValueError("no episode with tokens to train on")
    return minibatches(rows, algo.num_minibatches, algo.loss_agg, algo.norm_tokens, micro_batch_tokens, seed)
