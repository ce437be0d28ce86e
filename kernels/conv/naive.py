"""Pure-PyTorch reference of the varlen causal depthwise conv (the model's shifted-tap form).

y[t, c] = act(sum_{j < K} w[c, K-1-j] * x[t-j, c] * [pos[t] >= j]): tap j reads the input j steps
back, and only inside the token's own sequence (pos = position within the sequence), so packed
sequences never see each other. Computed in x's dtype, one tap at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_naive(
    x_BTC: torch.Tensor, w_CK: torch.Tensor, pos_BT: torch.Tensor, activation: str | None = "silu"
) -> torch.Tensor:
    K, T = w_CK.shape[1], x_BTC.shape[1]
    w_CK = w_CK.to(x_BTC.dtype)
    y_BTC = x_BTC * w_CK[:, K - 1]
    for j in range(1, K):
        shifted_BTC = F.pad(x_BTC, (0, 0, j, 0))[:, :T]
        y_BTC = y_BTC + shifted_BTC * (pos_BT >= j)[..., None] * w_CK[:, K - 1 - j]
    return F.silu(y_BTC) if activation == "silu" else y_BTC


def conv_state_step_naive_(
    x_NC: torch.Tensor, state_PCW: torch.Tensor, slots_N: torch.Tensor, w_CK: torch.Tensor, silu: bool
) -> torch.Tensor:
    """One decode step of the conv for N sequences whose windows (the last K-1 inputs, oldest first) live in
    ``state_PCW`` at ``slots_N``: y = act(sum_j w[:, j] [window, x][:, j]) [N, C] in x's dtype, and each
    window shifted in place to end with x. A negative slot is a padding entry (vLLM's PAD_SLOT_ID): its
    output is zero and no window is touched. Reads the slots on the host (the Triton kernel does not)."""
    y_NC = torch.zeros_like(x_NC)
    live_N = (slots_N >= 0).nonzero()[:, 0]
    if live_N.numel():
        slots = slots_N[live_N].long()
        window_NCK = torch.cat([state_PCW[slots].to(x_NC.dtype), x_NC[live_N, :, None]], dim=-1)
        y = (window_NCK * w_CK.to(x_NC.dtype)).sum(-1)
        y_NC[live_N] = F.silu(y) if silu else y
        state_PCW[slots] = window_NCK[..., 1:].to(state_PCW.dtype)
    return y_NC
