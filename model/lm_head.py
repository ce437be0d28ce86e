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


def chunk_stats(z_CV: torch.Tensor, targets_C1: torch.Tensor, with_entropy: bool):
    """(lse, logp, entropy or None) [C] in fp32 of one chunk's logits (any dtype) and targets [C, 1]: a
    function of tensors and constants, one compiled region under ``model.compile`` (the fp32 [C, V] copy is
    then never written). Per-token inputs are [C, 1] columns: the compiled regions keep every dim but the
    last dynamic, so a new chunk length reuses the graph."""
    z = z_CV.float()
    lse_C = z.logsumexp(-1)
    logp_C = z.gather(-1, targets_C1)[:, 0] - lse_C
    if not with_entropy:
        return lse_C, logp_C, None
    return lse_C, logp_C, lse_C - ((z - lse_C[:, None]).exp() * z).sum(-1)


def chunk_logits_grad(z_CV, targets_C1, lse_C1, ent_C1, g_logp_C1, g_ent_C1, dtype: torch.dtype) -> torch.Tensor:
    """d(loss)/dz [C, V] in ``dtype`` from the upstream gradients of logp and entropy ([C, 1] columns, either
    may be None): dlogp/dz = onehot(y) - p, dH/dz = -p (z - E_p[z]) with E_p[z] = lse - H; one compiled
    region."""
    z = z_CV.float()
    p_CV = (z - lse_C1).exp()
    dz_CV = torch.zeros_like(z)
    if g_ent_C1 is not None:
        dz_CV = dz_CV - g_ent_C1 * p_CV * (z - (lse_C1 - ent_C1))
    if g_logp_C1 is not None:  # the one-hot as a comparison, not a scatter: one element-wise kernel compiled
        onehot_CV = torch.arange(z.shape[-1], device=z.device) == targets_C1
        dz_CV = dz_CV - g_logp_C1 * (p_CV - onehot_CV.float())
    return dz_CV.to(dtype)


class LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk: int, with_entropy: bool, fns: tuple):
        stats_fn, _ = fns
        T = h_TD.shape[0]
        logp_T = torch.empty(T, device=h_TD.device, dtype=torch.float32)
        lse_T = torch.empty_like(logp_T)
        ent_T = torch.empty_like(logp_T) if with_entropy else None
        for s in range(0, T, chunk):
            lse_C, logp_C, ent_C = stats_fn(F.linear(h_TD[s : s + chunk], w_VD), targets_T[s : s + chunk, None],
                                            with_entropy)  # fmt: skip
            lse_T[s : s + chunk], logp_T[s : s + chunk] = lse_C, logp_C
            if with_entropy:
                ent_T[s : s + chunk] = ent_C
        ctx.save_for_backward(h_TD, w_VD, targets_T, lse_T, ent_T)
        ctx.chunk, ctx.grad_fn = chunk, fns[1]
        ctx.set_materialize_grads(False)
        return logp_T, ent_T

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T):
        h_TD, w_VD, targets_T, lse_T, ent_T = ctx.saved_tensors
        chunk = ctx.chunk
        dh_TD = torch.zeros_like(h_TD)
        dw_VD = torch.zeros(w_VD.shape, device=w_VD.device, dtype=torch.float32)
        if g_logp_T is None and g_ent_T is None:
            return dh_TD, dw_VD.to(w_VD.dtype), None, None, None, None
        for s in range(0, h_TD.shape[0], chunk):
            c = slice(s, s + chunk)
            h_CD = h_TD[c]
            col = [None if t is None else t[c, None] for t in (targets_T, lse_T, ent_T, g_logp_T, g_ent_T)]
            dz_CV = ctx.grad_fn(F.linear(h_CD, w_VD), *col, h_TD.dtype)
            dh_TD[c] = dz_CV @ w_VD
            dw_VD += (dz_CV.transpose(0, 1) @ h_CD).float()
        return dh_TD, dw_VD.to(w_VD.dtype), None, None, None, None


def chunked_logprobs_entropy(
    lm_head: nn.Linear,
    h_BTD: torch.Tensor,
    target_ids_BT: torch.Tensor,
    with_entropy: bool = False,
    chunk: int = DEFAULT_CHUNK,
    fns: tuple = (chunk_stats, chunk_logits_grad),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target_t | <= t) [B, T], entropy of the next-token distribution [B, T] or None), fp32.

    Takes the autocast dtype like nn.Linear would (cast outside the Function, so W's gradient
    reaches the fp32 master weight through the cast). ``fns``: the per-chunk forward and backward math
    (``chunk_stats``, ``chunk_logits_grad``, or compiled versions of them: ``model.compile``)."""
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
            chunk, with_entropy, fns,
        )  # fmt: skip
    return logp_T.view(B, T), None if ent_T is None else ent_T.view(B, T)


def logits_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, fp32 (the plain path)."""
    z = logits_BTV.float()
    return z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)
