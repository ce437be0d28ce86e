"""Latent MLA decode over vLLM's paged cache (the rollout engine's absorbed attention), reference and Triton.

    latent_decode_naive(q [T, H, D], k_cache [blocks, block, 1, D'], out [T, H, D], cu_seqlens_q [S + 1],
                        seqused_k [S], block_table [S, pages], scale, rank, rope)     PyTorch, any device
    latent_decode_triton(...)                                  same function, CUDA (or TRITON_INTERPRET=1)

One query token a sequence, H heads over ONE latent head whose key is [c_kv ; k_pe] and whose value is c_kv
(the key's first ``rank`` columns): ``rollout.vllm_layers`` routes the latent form's decode-only steps here on
vLLM's Triton backend. Import-light: the Triton module loads on first use.
"""

from __future__ import annotations

from kernels.mla.naive import latent_decode_naive

__all__ = ["latent_decode_naive", "latent_decode_triton"]


def latent_decode_triton(q_THD, k_cache_BNKD, out_THD, cu_seqlens_q, seqused_k, block_table, scale, rank, rope,
                         **launch):  # fmt: skip
    from kernels.mla.triton import latent_decode_triton as impl

    return impl(q_THD, k_cache_BNKD, out_THD, cu_seqlens_q, seqused_k, block_table, scale, rank, rope, **launch)
