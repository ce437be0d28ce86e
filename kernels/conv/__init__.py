"""Varlen causal depthwise conv1d (the KDA short convolution), reference and Triton kernel.

    causal_conv1d_naive(x [B, T, C], w [C, K], pos [B, T], activation)   PyTorch, any device/dtype
    causal_conv1d_triton(...)                                             same function, CUDA (or
                                                                          TRITON_INTERPRET=1)

``pos`` is each token's position inside its own sequence (``model.layers.SeqLayout.pos_BT``), so
one call covers a packed micro-batch of many sequences. No conv state in or out: the model's
stateful path (prefill over a cache, decode) stays in ``model.layers.ShortConvolution``.
Import-light: the Triton module loads on first use.
"""

from __future__ import annotations

from kernels.conv.naive import causal_conv1d_naive

__all__ = ["causal_conv1d_naive", "causal_conv1d_triton"]


def causal_conv1d_triton(x_BTC, w_CK, pos_BT, activation="silu"):
    from kernels.conv.triton import causal_conv1d_triton as impl

    return impl(x_BTC, w_CK, pos_BT, activation)
