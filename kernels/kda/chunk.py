"""Chunked KDA. Placeholder that defers to the reference until the chunked path lands."""

from kernels.kda.naive import naive_recurrent_kda


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
