"""Pure-PyTorch reference of the grouped matrix product: one ``x @ w[g]^T`` per group, in a loop.

Readable and exact (any dtype, float64 included); the offsets are read on the host (a device sync
on CUDA), so it is the reference the fast paths are tested against, not a hot path.
"""

from __future__ import annotations

import torch


def grouped_mm_naive(x_SK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """y [S, N]: rows ``offs[g-1]:offs[g]`` of x times ``w[g]^T`` (nn.Linear layout); rows past
    ``offs[-1]`` are zero."""
    ends = [int(e) for e in offs_G.tolist()]
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(x_SK[start:end] @ w_GNK[g].transpose(0, 1))
        start = max(start, end)
    tail = x_SK.shape[0] - start
    if tail or not pieces:
        pieces.append(x_SK.new_zeros(tail, w_GNK.shape[1]))
    return torch.cat(pieces)


def grouped_mm_naive_dw(dy_SN: torch.Tensor, x_SK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """The weight gradient of ``grouped_mm_naive``: dw [G, N, K] with dw[g] = dy[rows of g]^T x[rows of g] (an
    empty group gets zeros; rows past ``offs[-1]`` count nowhere)."""
    ends, start = [int(e) for e in offs_G.tolist()], 0
    dw = dy_SN.new_zeros(len(ends), dy_SN.shape[1], x_SK.shape[1])
    for g, end in enumerate(ends):
        if end > start:
            dw[g] = dy_SN[start:end].transpose(0, 1) @ x_SK[start:end]
        start = max(start, end)
    return dw
