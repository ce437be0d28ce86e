"""Block Attention Residuals (AttnRes paper, arXiv 2603.15031; K3 Eq. 8-10).

Instead of adding every sub-layer output to one residual stream, each sub-layer (attention, MoE)
and the final output read a softmax mixture of a few sources: the token embedding, each completed
block's summed output, and the running sum of the current block:

    h = sum_i softmax_i(w^T RMSNorm(v_i)) v_i

with a learned pseudo-query w per sub-layer, zero-initialised (uniform mixing at step 0), no
temperature, keys RMS-normalised, values not. Wiring follows NeMo's ``_forward_attn_residual`` /
FLA's ``KDABlock.forward`` (see model/modeling.py).

Memory: autograd on the mix keeps the stacked sources, their fp32 RMS-normalised copy and the
normed output, about three [S, B, T, D] fp32 tensors per mix (33 mixes in gpu_1b). With
``model.fast`` op "attn_res" = ``recompute`` (the default) only the sources are kept (they are the
block sums the model holds anyway) and the mix is recomputed in backward: the same ops, bit-exact.
"""

from __future__ import annotations

import torch
from torch import nn

from model import fast
from model.layers import RMSNorm, f32, recompute_in_backward


class AttnResMix(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.norm = RMSNorm(hidden_size, eps=eps)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0]
        if fast.pick("attn_res", sources[0].device) == "recompute":
            return recompute_in_backward(self.mix, *sources)
        return self.mix(*sources)

    def mix(self, *sources: torch.Tensor) -> torch.Tensor:
        """The reference mix of two or more sources; ``model.compile`` compiles it."""
        v_SBTD = torch.stack(sources)
        logits_SBT = (f32(self.norm(v_SBTD)) * f32(self.query)).sum(-1)
        a_SBT = logits_SBT.softmax(dim=0)
        return (a_SBT[..., None] * f32(v_SBTD)).sum(0).to(v_SBTD.dtype)
