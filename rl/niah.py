"""Needle-in-a-haystack validation between curriculum stages (teacher-forced, on the learner).

For each context length L, ``num_samples`` NeedleHaystack tasks (facts hidden in filler text, the
answer needs two of them) are sized to fit in L tokens and rendered with the scripted expert's
turns. The learner scores the expert's assistant tokens given the whole haystack:
``niah/L/nll`` (mean negative log-likelihood per assistant token) and ``niah/L/p_gt_half`` (the
fraction of assistant tokens it predicts with probability > 1/2, i.e. surely greedy-correct).
Teacher forcing measures retrieval over the whole context without paying for generation; it is a
validation signal, not the held-out success rate (that comes from ``rl/rollouts.evaluate``).
"""

from __future__ import annotations

from typing import Any

import torch

from envs.types import Episode
from rl.batching import episode_row, pack
from rl.sft import expert_episode


def niah_episodes(length_tokens: int, num_samples: int, renderer, seed: int = 0) -> list[Episode]:
    """Expert NeedleHaystack episodes of at most ``length_tokens`` tokens (filler shrunk to fit)."""
    import envs

    chars = 2 * length_tokens
    out: list[Episode] = []
    for i in range(num_samples):
        for _ in range(6):
            env = envs.make("NeedleHaystack", context_chars=max(chars, 100))
            ep = expert_episode(env, renderer, {"split": "test", "task_index": seed + i}, "NeedleHaystack")
            n = len(ep.token_ids)
            if n <= length_tokens:
                break
            chars = int(chars * 0.9 * length_tokens / n)
        else:
            raise ValueError(f"NeedleHaystack does not fit in {length_tokens} tokens even with {chars} chars")
        out.append(ep)
    return out


def niah_metrics(learner: Any, episodes_by_length: dict[int, list[Episode]]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for length, eps in episodes_by_length.items():
        batch = pack([episode_row(e, [0.0] * len(e.turns)) for e in eps], "token_mean", 1)
        lp_T = learner.logprobs(batch)
        w_T = batch.token_weights_T
        metrics[f"niah/{length}/nll"] = float(-(w_T * lp_T).sum())
        metrics[f"niah/{length}/p_gt_half"] = float(
            (w_T * (lp_T > torch.log(torch.tensor(0.5))).float()).sum()
        )
    return metrics
