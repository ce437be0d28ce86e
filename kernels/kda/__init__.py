"""Kimi Delta Attention: the float64 reference and the chunked fast path.

Public API (flash-linear-attention's convention):
    naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None) -> (o, final_state)
    chunk_kda(...)  same signature; CPU tensors use the chunked PyTorch path.
"""

from kernels.kda.chunk import chunk_kda
from kernels.kda.naive import naive_recurrent_kda

__all__ = ["chunk_kda", "naive_recurrent_kda"]
