"""Pure-PyTorch reference of the latent MLA decode step over vLLM's paged cache.

One decode query per sequence, H query heads sharing ONE latent KV head (the absorbed form of
``rollout.vllm_layers.MLALatentPagedAttention``): each cached token's key is [c_kv ; k_pe] (its first
``rank + rope`` columns, the rest zero padding) and its value is c_kv, the same columns. So

    out[i, h, :rank] = sum_j softmax_j(scale * q[i, h] . K[j]) c_kv[j]

over sequence i's first ``seqused_k[i]`` tokens, read through its row of the block table. The
output's columns past ``rank`` are zero (the value's padding). A sequence with no query token
(``cu_seqlens_q`` repeats, a padded batch entry) or no key is left untouched.
"""

from __future__ import annotations

import torch


def latent_decode_naive(
    q_THD: torch.Tensor, k_cache_BNKD: torch.Tensor, out_THD: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor, block_table: torch.Tensor, scale: float, rank: int, rope: int,
) -> torch.Tensor:  # fmt: skip
    """Writes ``out_THD`` (and returns it); fp32 softmax and sums, the output cast to its dtype."""
    block = k_cache_BNKD.shape[1]
    starts, used = cu_seqlens_q.tolist(), seqused_k.tolist()
    for i, n in enumerate(used):
        if starts[i + 1] == starts[i] or n == 0:
            continue
        rows = torch.arange(n, device=q_THD.device)
        pages = block_table[i, rows // block].long()
        keys = k_cache_BNKD[pages, rows % block, 0, : rank + rope].float()  # [n, rank + rope]
        t = starts[i]
        p = torch.softmax(q_THD[t, :, : rank + rope].float() @ keys.T * scale, dim=-1)  # [H, n]
        out_THD[t] = 0
        out_THD[t, :, :rank] = (p @ keys[:, :rank]).to(out_THD.dtype)
    return out_THD
