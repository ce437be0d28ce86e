"""One clipped policy-gradient objective; every algorithm in ``rl/algorithms.py`` is a setting of it.

Per sampled token t of episode i, with learner logprob l_t, old (pre-update) logprob o_t, rollout
logprob q_t, advantage A_t and aggregation weight w_t:

    ratio_t   = exp(l_t - o_t)                                         (ratio_level = token)
              = exp(sg(mean_{s in i}(l_s - o_s)) + l_t - sg(l_t))      (ratio_level = sequence, GSPO)
    pg_t      = max(-A_t ratio_t, -A_t clip(ratio_t, 1 - clip_low, 1 + clip_high))
    pg_t      = min(pg_t, -A_t * dual_clip)   where A_t < 0              (dual clip, optional)
    tis_t     = sg(min(exp(o_t - q_t), tis_cap))                        (truncated IS vs the rollout engine)
    kl_t      = l_t - r_t (k1)   or   exp(r_t - l_t) - (r_t - l_t) - 1 (k3), r = reference logprob
    loss      = sum_t w_t (tis_t pg_t + kl_coef kl_t - entropy_coef H_t)  [+ vf_coef value loss]

The normaliser lives in the weights w_t (``token_weights``), fixed once per optimizer step over the
whole mini-batch, so micro-batching and gradient accumulation give exactly the full-batch gradient:

- ``seq_mean_token_mean``: w_t = 1 / (N |y_i|)   (GRPO, GSPO; biased toward short episodes when length
                                                   depends on the policy)
- ``token_mean``:          w_t = 1 / sum_i |y_i|  (DAPO; still couples episodes through the total)
- ``constant``:            w_t = 1 / (N L)        with L = ``norm_tokens`` fixed (Dr.GRPO): the loss is a
                                                   plain sum over sampled tokens scaled by a constant,
                                                   so its gradient is unbiased when |y_i| varies with
                                                   the policy.

Only sampled tokens carry loss: every other token has w_t = 0 and its log-ratio is zeroed before the
exponential, so it contributes exactly zero gradient (no 0 * inf).

Deviations: GSPO's sequence ratio here spans all sampled tokens of a multi-turn episode; the TIS
weight is per token also in the sequence-level form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.config import AlgorithmConfig


@dataclass
class LossInputs:
    """One packed micro-batch; every tensor is [T] over the packed tokens."""

    logprobs_T: torch.Tensor  # learner logprobs (with grad)
    old_logprobs_T: torch.Tensor  # pre-update learner logprobs (no grad)
    rollout_logprobs_T: torch.Tensor  # what the rollout engine reported when sampling
    advantages_T: torch.Tensor
    token_weights_T: torch.Tensor  # aggregation weights, 0 on tokens that carry no loss
    loss_mask_T: torch.Tensor  # bool, True on sampled tokens
    seq_ids_T: torch.Tensor  # long, episode index of each token within the micro-batch
    ref_logprobs_T: torch.Tensor | None = None
    entropy_T: torch.Tensor | None = None
    values_T: torch.Tensor | None = None  # value head output (with grad)
    old_values_T: torch.Tensor | None = None
    value_targets_T: torch.Tensor | None = None
    value_weights_T: torch.Tensor | None = None  # 1/num_boundaries at turn boundaries, else 0
    num_seqs: int | None = None  # sequences in the micro-batch (from the host); None: read from seq_ids_T (a sync)


def token_weights(
    loss_mask_T: torch.Tensor, seq_ids_T: torch.Tensor, mode: str, norm_tokens: int
) -> torch.Tensor:
    """Aggregation weights w_t for one optimizer step's worth of episodes (see module docstring)."""
    mask = loss_mask_T.to(torch.float32)
    num_seqs = int(seq_ids_T.max().item()) + 1 if seq_ids_T.numel() else 0
    if mode == "token_mean":
        return mask / mask.sum().clamp_min(1.0)
    if mode == "constant":
        return mask / max(num_seqs * norm_tokens, 1)
    if mode == "seq_mean_token_mean":
        per_seq = torch.zeros(num_seqs, dtype=torch.float32).index_add_(0, seq_ids_T, mask)
        # episodes without sampled tokens count toward N (they were sampled) but have no tokens to weight
        return mask / (per_seq.clamp_min(1.0)[seq_ids_T] * max(num_seqs, 1))
    raise ValueError(f"unknown loss_agg {mode!r}")


def _segment_mean(x_T: torch.Tensor, seq_ids_T: torch.Tensor, mask_T: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Mean of x over the masked tokens of each sequence, broadcast back to [T]. ``n``: the number of sequences
    when the caller knows it on the host (else read back from the device: a sync between forward and backward)."""
    n = n if n is not None else int(seq_ids_T.max().item()) + 1
    m = mask_T.to(x_T.dtype)
    sums = torch.zeros(n, dtype=x_T.dtype, device=x_T.device).index_add(0, seq_ids_T, x_T * m)
    counts = torch.zeros(n, dtype=x_T.dtype, device=x_T.device).index_add(0, seq_ids_T, m)
    return (sums / counts.clamp_min(1.0))[seq_ids_T]


def log_ratio(inp: LossInputs, ratio_level: str) -> torch.Tensor:
    """log pi/pi_old per token, zero where no loss is carried."""
    lr_T = torch.where(inp.loss_mask_T, inp.logprobs_T - inp.old_logprobs_T, torch.zeros_like(inp.logprobs_T))
    if ratio_level == "token":
        return lr_T
    if ratio_level == "sequence":
        seq_T = _segment_mean(lr_T.detach(), inp.seq_ids_T, inp.loss_mask_T, inp.num_seqs)
        return torch.where(inp.loss_mask_T, seq_T + inp.logprobs_T - inp.logprobs_T.detach(), lr_T)
    raise ValueError(f"unknown ratio_level {ratio_level!r}")


def kl_penalty(logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate on samples from pi: k1 (unbiased, signed) or k3 (>= 0)."""
    d_T = ref_logprobs_T - logprobs_T
    if estimator == "k1":
        return -d_T
    if estimator == "k3":
        return torch.exp(d_T) - d_T - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}")


def tis_weights(old_logprobs_T: torch.Tensor, rollout_logprobs_T: torch.Tensor, mask_T, cap: float | None):
    """Truncated importance weight pi_old / pi_rollout, capped; 1 where off or masked. No gradient."""
    if cap is None:
        return torch.ones_like(old_logprobs_T)
    d_T = torch.where(mask_T, old_logprobs_T - rollout_logprobs_T, torch.zeros_like(old_logprobs_T))
    return torch.exp(d_T).clamp(max=cap).detach()


def clipped_pg(
    ratio_T: torch.Tensor, adv_T: torch.Tensor, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (to minimise) and a 0/1 tensor marking where clipping was active."""
    unclipped_T = -adv_T * ratio_T
    clipped_T = -adv_T * ratio_T.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg_T = torch.maximum(unclipped_T, clipped_T)
    if cfg.dual_clip is not None:
        pg_T = torch.where(adv_T < 0, torch.minimum(pg_T, -adv_T * cfg.dual_clip), pg_T)
    return pg_T, (clipped_T > unclipped_T).to(ratio_T.dtype)


def value_loss(inp: LossInputs, clip: float | None) -> torch.Tensor:
    """0.5 * squared error at turn boundaries, optionally clipped around the old values (PPO)."""
    err_T = (inp.values_T - inp.value_targets_T) ** 2
    if clip is not None and inp.old_values_T is not None:
        v_clip_T = inp.old_values_T + (inp.values_T - inp.old_values_T).clamp(-clip, clip)
        err_T = torch.maximum(err_T, (v_clip_T - inp.value_targets_T) ** 2)
    return 0.5 * (inp.value_weights_T * err_T).sum()


def policy_loss(inp: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective of the module docstring for one micro-batch; returns (loss, metric sums)."""
    loss, stats = policy_loss_stats(inp, cfg)
    return loss, metric_floats(stats)


def policy_loss_stats(inp: LossInputs, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy_loss`` with its metrics as detached 0-dim tensors on the loss's device: nothing is read back
    to the host between the forward and the backward (the learner reads a step's metrics once, after it)."""
    w_T, mask_T = inp.token_weights_T, inp.loss_mask_T
    ratio_T = torch.exp(log_ratio(inp, cfg.ratio_level))
    pg_T, clipped_T = clipped_pg(ratio_T, inp.advantages_T, cfg)
    tis_T = tis_weights(inp.old_logprobs_T, inp.rollout_logprobs_T, mask_T, cfg.tis_cap)
    per_token_T = tis_T * pg_T
    with torch.no_grad():
        masked_max = torch.where(mask_T, ratio_T, torch.full_like(ratio_T, -torch.inf)).max()
        metrics = {"pg_loss": (w_T * pg_T).sum(), "clip_frac": (w_T * clipped_T).sum(),
                   "ratio_max": torch.where(mask_T.any(), masked_max, torch.ones_like(masked_max)),
                   "tis_weight": (w_T * tis_T).sum()}  # fmt: skip
    if inp.ref_logprobs_T is not None and cfg.kl_coef > 0:
        kl_T = torch.where(mask_T, kl_penalty(inp.logprobs_T, inp.ref_logprobs_T, cfg.kl_estimator), 0.0)
        per_token_T = per_token_T + cfg.kl_coef * kl_T
        metrics["kl_ref"] = (w_T * kl_T).detach().sum()
    if inp.entropy_T is not None:
        metrics["entropy"] = (w_T * inp.entropy_T).detach().sum()
        if cfg.entropy_coef > 0:
            per_token_T = per_token_T - cfg.entropy_coef * inp.entropy_T
    loss = (w_T * per_token_T).sum()
    if inp.values_T is not None and (cfg.vf_coef or 0) > 0:
        vl = value_loss(inp, cfg.value_clip)
        loss = loss + cfg.vf_coef * vl
        metrics["value_loss"] = vl.detach()
    metrics["loss"] = loss.detach()
    return loss, {k: v.double() for k, v in metrics.items()}


def metric_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim metric tensors as floats, read back to the host in one copy."""
    if not stats:
        return {}
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))
