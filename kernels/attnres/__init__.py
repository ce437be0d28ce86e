"""The Block AttnRes mix and the sub-layer's RMSNorm after it, for inference, as one Triton kernel.

    attn_res_mix_norm_triton(query [D], key_weight [D], eps, out_weight [D], out_eps, v [S, ..., D])
        = rms_norm(attn_res_mix_stacked(query, key_weight, eps, v), out_weight, out_eps)   (model.attnres)
    attn_res_mix_norm_sources_triton(query, key_weight, eps, out_weight, out_eps, *sources)
        the same over the sources where they are (no stacked copy): the learner's forward kernel
        (``kernels.attnres.triton.mix_norm_forward``) for up to ``MAX_SOURCES`` sources, else stacked

One program per token row reads the row of every source once: the keys' RMS norm and their dot products with
the query, an online softmax over the sources, the weighted sum in fp32 rounded to the sources' dtype (as the
reference rounds the mix), then the sub-layer's RMSNorm. No backward: the engine's mixes only, where the
compiled stacked mix and the norm after it were four to five kernels a mix and a compile of their own at the
engine's start. ``model.serving.prepare_for_serving`` picks the sources' form on CUDA: stacking was one more copy
kernel a mix (31 a gpu_1b decode step), and the engine's mixes run the learner's own kernel. The reference stays
in ``model.attnres``; tests/kernels/test_attnres_mix_norm.py holds the kernel to it under TRITON_INTERPRET=1.
Import-light: the Triton module loads on first use.
"""

from __future__ import annotations

import torch


def attn_res_mix_norm_triton(
    query: torch.Tensor, key_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    v_SND: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    from kernels.attnres.triton import mix_norm_rows

    return mix_norm_rows(query, key_weight, eps, out_weight, out_eps, v_SND)


def attn_res_mix_norm_sources_triton(
    query: torch.Tensor, key_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    *sources: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    from kernels.attnres.triton import MAX_SOURCES, mix_norm_forward

    if len(sources) <= MAX_SOURCES:
        return mix_norm_forward(query, key_weight, eps, out_weight, out_eps, *sources)
    return attn_res_mix_norm_triton(query, key_weight, eps, out_weight, out_eps, torch.stack(sources))
