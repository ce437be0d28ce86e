"""Kimi Delta Attention: the float64 reference, the chunked path and the decode recurrence.

Public API (flash-linear-attention's convention):
    naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None) -> (o, final_state)
    chunk_kda(...)            same signature; CPU tensors use the chunked PyTorch path,
                              CUDA tensors the Triton kernels. Contract: g >= -5 (lower_bound=).
    fused_recurrent_kda(...)  same signature; fp32 step recurrence for decoding.
    kda_decode_step_(q, k, v, g, beta, state_pool, state_indices, scale=None) -> o
                              decode with states read and written in place in a slot pool.
"""

from kernels.kda.chunk import chunk_kda
from kernels.kda.naive import naive_recurrent_kda
from kernels.kda.recurrent import fused_recurrent_kda, kda_decode_step_

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_decode_step_", "naive_recurrent_kda"]
