"""LM head, token log-probability and entropy over chunks of tokens: [T, V] logits never exist at once.

For hidden states h [T, D], head weight W [V, D] and targets y [T], per token (fp32):

    z = W h (in h's compute dtype, then fp32),  lse = logsumexp(z),  logp = z_y - lse,
    H = lse - sum_v p_v z_v                       (p = softmax(z))

``LogprobEntropy`` computes them a chunk of tokens at a time and keeps only h, W, y and the per-token
lse and H; its backward recomputes each chunk's logits and applies

    dlogp/dz = onehot(y) - p,      dH/dz = -p (z - E_p[z])     (E_p[z] = lse - H)

so the memory of the head is O(chunk x V) in forward and backward alike. Against the plain path
(``model.fast`` op "lm_head" = "plain": [T, V] logits, log-softmax, autograd) the only difference is
rounding: the weight gradient is summed over chunks in fp32 (each chunk's product in the compute
dtype), where the plain path rounds one product over all tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK = 2048


class LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk: int, with_entropy: bool):
        T = h_TD.shape[0]
        logp_T = torch.empty(T, device=h_TD.device, dtype=torch.float32)
        lse_T = torch.empty_like(logp_T)
        ent_T = torch.empty_like(logp_T) if with_entropy else None
        for s in range(0, T, chunk):
            z_CV = F.linear(h_TD[s : s + chunk], w_VD).float()
            lse_C = z_CV.logsumexp(-1)
            lse_T[s : s + chunk] = lse_C
            logp_T[s : s + chunk] = z_CV.gather(-1, targets_T[s : s + chunk, None])[:, 0] - lse_C
            if with_entropy:
                p_CV = (z_CV - lse_C[:, None]).exp_()
                ent_T[s : s + chunk] = lse_C - (p_CV * z_CV).sum(-1)
        ctx.save_for_backward(h_TD, w_VD, targets_T, lse_T, ent_T)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        return logp_T, ent_T

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T):
        h_TD, w_VD, targets_T, lse_T, ent_T = ctx.saved_tensors
        chunk = ctx.chunk
        dh_TD = torch.zeros_like(h_TD)
        dw_VD = torch.zeros(w_VD.shape, device=w_VD.device, dtype=torch.float32)
        if g_logp_T is None and g_ent_T is None:
            return dh_TD, dw_VD.to(w_VD.dtype), None, None, None
        for s in range(0, h_TD.shape[0], chunk):
            h_CD = h_TD[s : s + chunk]
            z_CV = F.linear(h_CD, w_VD).float()
            p_CV = (z_CV - lse_T[s : s + chunk, None]).exp_()
            dz_CV = torch.zeros_like(z_CV)
            if g_ent_T is not None:  # dH/dz = -p (z - E_p[z]), E_p[z] = lse - H
                mean_z_C = lse_T[s : s + chunk] - ent_T[s : s + chunk]
                dz_CV -= g_ent_T[s : s + chunk, None] * p_CV * (z_CV - mean_z_C[:, None])
            if g_logp_T is not None:  # dlogp/dz = onehot(y) - p
                g_C = g_logp_T[s : s + chunk]
                dz_CV -= g_C[:, None] * p_CV
                dz_CV.scatter_add_(-1, targets_T[s : s + chunk, None], g_C[:, None])
            dz_CV = dz_CV.to(h_TD.dtype)
            dh_TD[s : s + chunk] = dz_CV @ w_VD
            dw_VD += (dz_CV.transpose(0, 1) @ h_CD).float()
        return dh_TD, dw_VD.to(w_VD.dtype), None, None, None


def chunked_logprobs_entropy(
    lm_head: nn.Linear,
    h_BTD: torch.Tensor,
    target_ids_BT: torch.Tensor,
    with_entropy: bool = False,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target_t | <= t) [B, T], entropy of the next-token distribution [B, T] or None), fp32.

    Takes the autocast dtype like nn.Linear would (cast outside the Function, so W's gradient
    reaches the fp32 master weight through the cast)."""
    if h_BTD.shape[:2] != target_ids_BT.shape:
        raise ValueError(
            f"target_ids {tuple(target_ids_BT.shape)} must match hidden states {tuple(h_BTD.shape[:2])}"
        )
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("the chunked LM head takes a head without bias")
    B, T, D = h_BTD.shape
    dev = h_BTD.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h_BTD.dtype
    with torch.autocast(dev, enabled=False):
        logp_T, ent_T = LogprobEntropy.apply(
            h_BTD.reshape(B * T, D).to(dt), lm_head.weight.to(dt), target_ids_BT.reshape(-1).long(),
            chunk, with_entropy,
        )  # fmt: skip
    return logp_T.view(B, T), None if ent_T is None else ent_T.view(B, T)


def logits_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, fp32 (the plain path)."""
    z = logits_BTV.float()
    return z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)
