"""Algorithm presets: each named algorithm is a row of parameters of ONE clipped policy-gradient loss.

Nothing in ``rl/losses.py`` or ``rl/advantages.py`` branches on these names; they only choose
values. A field left ``null`` in the config takes the preset's value; any field set explicitly
wins over the preset.

Column meanings (see ``AlgorithmConfig`` in ``rl/config.py`` for the full docstrings):

- baseline:     what is subtracted from the return: ``group_mean`` (GRPO family), ``leave_one_out``
                (RLOO), ``batch_mean`` (REINFORCE++), ``value`` (PPO critic), ``none``.
- std_norm:     divide advantages by the std of the ``group``, the whole ``batch``, or ``none``.
- ratio_level:  ``token`` importance ratio, or ``sequence`` (GSPO: geometric mean over the episode).
- clip_low/high: the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO: asymmetric).
- loss_agg:     per-token weights of the loss sum, fixed for the whole step:
                ``seq_mean_token_mean`` (1 / (N * |y_i|)), ``token_mean`` (1 / sum_i |y_i|),
                ``constant`` (1 / (N * norm_tokens), Dr.GRPO; unbiased when lengths vary).
- dynamic_sampling: drop groups whose rewards are all equal (zero advantage) and sample more (DAPO).

Deviations from the papers: REINFORCE++ puts its KL in the reward; here every KL is a loss term
(``kl_coef``), which has the same first-order gradient for k1. RLOO's leave-one-out baseline is
applied per group of G episodes sampled for one task, as in the paper.
"""

from __future__ import annotations

from typing import Any

# name -> parameters. Read a row as: "<name> is the clipped PG loss with these settings".
PRESETS: dict[str, dict[str, Any]] = {
    #            baseline         std_norm  ratio      clip_low clip_high loss_agg               dyn.samp  value
    "grpo": dict(baseline="group_mean", std_norm="group", ratio_level="token", clip_low=0.2, clip_high=0.2,
                 loss_agg="seq_mean_token_mean", dynamic_sampling=False, vf_coef=0.0),
    "dr_grpo": dict(baseline="group_mean", std_norm="none", ratio_level="token", clip_low=0.2, clip_high=0.2,
                    loss_agg="constant", dynamic_sampling=False, vf_coef=0.0),
    "dapo": dict(baseline="group_mean", std_norm="group", ratio_level="token", clip_low=0.2, clip_high=0.28,
                 loss_agg="token_mean", dynamic_sampling=True, vf_coef=0.0),
    "gspo": dict(baseline="group_mean", std_norm="group", ratio_level="sequence", clip_low=3e-4,
                 clip_high=4e-4, loss_agg="seq_mean_token_mean", dynamic_sampling=False, vf_coef=0.0),
    "rloo": dict(baseline="leave_one_out", std_norm="none", ratio_level="token", clip_low=0.2, clip_high=0.2,
                 loss_agg="seq_mean_token_mean", dynamic_sampling=False, vf_coef=0.0),
    "reinforce_pp": dict(baseline="batch_mean", std_norm="batch", ratio_level="token", clip_low=0.2,
                         clip_high=0.2, loss_agg="token_mean", dynamic_sampling=False, vf_coef=0.0),
    "ppo": dict(baseline="value", std_norm="batch", ratio_level="token", clip_low=0.2, clip_high=0.2,
                loss_agg="token_mean", dynamic_sampling=False, vf_coef=0.5),
}  # fmt: skip

BASELINES = ("group_mean", "leave_one_out", "batch_mean", "value", "none")
STD_NORMS = ("group", "batch", "none")
RATIO_LEVELS = ("token", "sequence")
LOSS_AGGS = ("seq_mean_token_mean", "token_mean", "constant")
CREDITS = ("outcome", "turn", "gae")
KL_ESTIMATORS = ("k1", "k3")


def preset(name: str) -> dict[str, Any]:
    """The parameter row of ``name``; a clear error lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
