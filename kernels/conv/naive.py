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
