"""Credit assignment: episode groups -> one advantage per assistant turn (broadcast to its tokens).

Three ways to assign credit (``AlgorithmConfig.credit``):

- ``outcome``: every turn of an episode gets the episode's total reward R (the rubric's score).
- ``turn``:    per-turn rewards r_k (the env's turn reward; the rubric's remainder R - sum_k r_k is
               added to the last turn, so sum_k r_k = R) and discounted returns across turns,
               G_k = sum_{j>=k} gamma^(j-k) r_j. With gamma = 1 and only a final reward this equals
               ``outcome``.
- ``gae``:     turn-level GAE with the value V_k read at the boundary before turn k's first sampled
               token: delta_k = r_k + gamma V_{k+1} - V_k (V_K = 0 after the last turn, also for
               truncated episodes: a budget cut is treated as the end, not bootstrapped),
               A_k = sum_j (gamma lam)^j delta_{k+j}; value targets R_k = A_k + V_k.

Baselines (``outcome``/``turn``) are computed from the episode returns G_0 and subtracted from every
turn's return: ``group_mean`` (GRPO, Dr.GRPO, DAPO, GSPO), ``leave_one_out`` (RLOO:
b_i = (sum_j G_0j - G_0i) / (G - 1)), ``batch_mean`` (REINFORCE++), ``none``. Scale: ``group`` divides
by the population std of G_0 within the group (+ eps), ``batch`` by the std of the centred values over
the batch, ``none`` leaves it. Deviation from GRPO's paper: the group std is the population std
(ddof=0), as in most implementations.

The batch statistics (``batch_mean``, ``batch``) weight each episode by its number of sampled tokens
n_i: b = sum_i n_i G_0i / sum_i n_i and s^2 = sum_i n_i (c_i - c_bar)^2 / sum_i n_i over the centred
values c_i, which is the token-level whitening of REINFORCE++ (its paper and verl whiten over every
response token of the batch): under ``outcome`` credit every token of an episode carries G_0, so these
are exactly the mean and std over the batch's tokens, and a long episode counts as much as its tokens.
Under ``turn`` credit the statistics stay those of the episode returns G_0 (token-weighted), subtracted
from and dividing every turn's return, rather than of each token's own return, so that turn credit
keeps the meaning it has with every other baseline. The std is the population one (ddof=0; Bessel's
correction, which some implementations apply, changes it by sqrt(N / (N - 1)) over N tokens). A batch
without any sampled token falls back to equal episode weights. Group statistics stay per episode.

Tokens that the policy did not sample (template, tool and env tokens) never get an advantage: they
are masked out of the loss in ``rl/batching.py``, whatever this module returns.
"""

from __future__ import annotations

import math

from envs.types import Episode, EpisodeGroup
from rl.config import AlgorithmConfig

TurnValues = list[list[list[float]]]  # [group][episode][turn]


def turn_rewards(ep: Episode) -> list[float]:
    """Per-turn rewards summing to the episode reward: env rewards, rubric remainder on the last turn."""
    r = [float(t.reward) for t in ep.turns]
    if r:
        r[-1] += float(ep.reward) - sum(r)
    return r


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    out, acc = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        acc = rewards[k] + gamma * acc
        out[k] = acc
    return out


def turn_returns(groups: list[EpisodeGroup], credit: str, gamma: float) -> TurnValues:
    if credit == "outcome":
        return [[[float(ep.reward)] * len(ep.turns) for ep in g.episodes] for g in groups]
    return [[discounted_returns(turn_rewards(ep), gamma) for ep in g.episodes] for g in groups]


def _episode_return(ep: Episode, credit: str, gamma: float) -> float:
    """G_0: the return of the whole episode (what group baselines compare)."""
    if credit == "outcome" or not ep.turns:
        return float(ep.reward)
    return discounted_returns(turn_rewards(ep), gamma)[0]


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _weighted_mean_std(xs: list[float], ws: list[float]) -> tuple[float, float]:
    """Mean and population std of ``xs`` weighted by ``ws`` (equal weights when they sum to 0)."""
    if sum(ws) <= 0:
        ws = [1.0] * len(xs)
    n = sum(ws)
    if n <= 0:
        return 0.0, 0.0
    m = sum(w * x for x, w in zip(xs, ws)) / n
    return m, math.sqrt(sum(w * (x - m) ** 2 for x, w in zip(xs, ws)) / n)


def baselines(g0: list[list[float]], kind: str, tokens: list[list[float]] | None = None) -> list[list[float]]:
    """Per-episode baseline from the episode returns G_0, grouped as [group][episode]; ``tokens`` (the
    episodes' sampled-token counts, same shape) weight the batch mean (None: equal weights)."""
    if kind == "none":
        return [[0.0] * len(xs) for xs in g0]
    if kind == "group_mean":
        return [[sum(xs) / len(xs)] * len(xs) for xs in g0]
    if kind == "leave_one_out":
        return [[(sum(xs) - x) / (len(xs) - 1) if len(xs) > 1 else 0.0 for x in xs] for xs in g0]
    if kind == "batch_mean":
        m, _ = _weighted_mean_std(*_flat(g0, tokens))
        return [[m] * len(xs) for xs in g0]
    raise ValueError(f"baseline {kind!r} is not a return baseline (value baselines go through gae)")


def _flat(values: list[list[float]], tokens: list[list[float]] | None) -> tuple[list[float], list[float]]:
    flat = [x for xs in values for x in xs]
    return flat, ([w for ws in tokens for w in ws] if tokens is not None else [1.0] * len(flat))


def scales(
    g0: list[list[float]], base: list[list[float]], kind: str, eps: float,
    tokens: list[list[float]] | None = None,
) -> list[list[float]]:  # fmt: skip
    """Per-episode divisor: group std of G_0, batch std of the centred G_0 (token-weighted with
    ``tokens``), or 1."""
    if kind == "none":
        return [[1.0] * len(xs) for xs in g0]
    if kind == "group":
        return [[_std(xs) + eps] * len(xs) for xs in g0]
    if kind == "batch":
        centred = [[x - b for x, b in zip(xs, bs)] for xs, bs in zip(g0, base)]
        s = _weighted_mean_std(*_flat(centred, tokens))[1] + eps
        return [[s] * len(xs) for xs in g0]
    raise ValueError(f"unknown std_norm {kind!r}")


def gae(
    rewards: list[float], values: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Turn-level GAE for one episode: (advantages, value targets), both [num_turns]."""
    if len(rewards) != len(values):
        raise ValueError(f"gae needs one value per turn: {len(rewards)} rewards, {len(values)} values")
    adv, acc = [0.0] * len(rewards), 0.0
    for k in reversed(range(len(rewards))):
        next_v = values[k + 1] if k + 1 < len(values) else 0.0
        delta = rewards[k] + gamma * next_v - values[k]
        acc = delta + gamma * lam * acc
        adv[k] = acc
    return adv, [a + v for a, v in zip(adv, values)]


def _whiten(adv: TurnValues, groups: list[EpisodeGroup], eps: float) -> TurnValues:
    """Batch whitening weighted by the sampled tokens of each turn (as token-level PPO whitening)."""
    pairs = [
        (a, len(t.token_ids))
        for g, ga in zip(groups, adv)
        for ep, ea in zip(g.episodes, ga)
        for t, a in zip(ep.turns, ea)
    ]
    n = sum(w for _, w in pairs)
    if n == 0:
        return adv
    m = sum(a * w for a, w in pairs) / n
    s = math.sqrt(sum(w * (a - m) ** 2 for a, w in pairs) / n) + eps
    return [[[(a - m) / s for a in ea] for ea in ga] for ga in adv]


def compute_advantages(
    groups: list[EpisodeGroup], cfg: AlgorithmConfig, values: TurnValues | None = None
) -> tuple[TurnValues, TurnValues | None]:
    """Per-turn advantages [group][episode][turn], and value targets when credit == "gae"."""
    if cfg.credit == "gae" or cfg.baseline == "value":
        if values is None:
            raise ValueError("credit=gae / baseline=value needs the value head's per-turn values")
        out = [
            [gae(turn_rewards(ep), v, cfg.gamma, cfg.lam) for ep, v in zip(g.episodes, gv)]
            for g, gv in zip(groups, values)
        ]
        adv = [[a for a, _ in go] for go in out]
        targets = [[t for _, t in go] for go in out]
        return (_whiten(adv, groups, cfg.adv_eps) if cfg.std_norm == "batch" else adv), targets
    returns = turn_returns(groups, cfg.credit, cfg.gamma)
    g0 = [[_episode_return(ep, cfg.credit, cfg.gamma) for ep in g.episodes] for g in groups]
    tokens = [[float(ep.num_sampled_tokens) for ep in g.episodes] for g in groups]
    base = baselines(g0, cfg.baseline, tokens)
    scale = scales(g0, base, cfg.std_norm, cfg.adv_eps, tokens)
    adv = [
        [[(r - b) / s for r in er] for er, b, s in zip(gr, gb, gs)]
        for gr, gb, gs in zip(returns, base, scale)
    ]
    return adv, None


def keep_group(group: EpisodeGroup, eps: float = 1e-9) -> bool:
    """Dynamic sampling (DAPO): a group whose rewards are all equal has zero advantage everywhere."""
    r = group.rewards
    return len(r) > 0 and (max(r) - min(r)) > eps
