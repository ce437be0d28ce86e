"""Varlen causal depthwise conv1d (the KDA short convolution), reference and Triton kernel.

    causal_conv1d_naive(x [B, T, C], w [C, K], pos [B, T], activation)   PyTorch, any device/dtype
    causal_conv1d_triton(..., backward)                                   same function, CUDA (or
                                                                          TRITON_INTERPRET=1); backward
                                                                          one of triton.BACKWARD_KERNELS
    causal_conv1d_state_triton(x, w, pos, seq [B, T], state [N, C, K-1])  continuing from conv states
                                                                          (forward only: the engine's prefill)

    conv_state_step_(x [N, C], state [P, C, K-1], slots [N], w [C, K], silu)   one decode step of N
                                                                          sequences, windows in place
    conv_state_steps_((x, ...), (state, ...), slots, (w, ...), silu)      the same for up to three convs
                                                                          over the same slots (one launch)

``pos`` is each token's position inside its own sequence (``model.layers.SeqLayout.pos_BT``), so
one call covers a packed micro-batch of many sequences. The model's stateful path (prefill over a cache,
decode) is ``model.layers.ShortConvolution``, which takes the state kernel for an inference prefill; the rollout
engine's decode steps the windows in vLLM's state slots with ``conv_state_steps_`` (the Triton kernel on
CUDA: one launch for a KDA layer's q, k and v convs, no gathers or scatters, padding slots skipped; the PyTorch
reference elsewhere).
Import-light: the Triton module loads on first use.
"""

from __future__ import annotations

import torch

from kernels.conv.naive import causal_conv1d_naive, conv_state_step_naive_

__all__ = [
    "causal_conv1d_naive", "causal_conv1d_state_triton", "causal_conv1d_triton", "conv_state_step_",
    "conv_state_step_naive_", "conv_state_steps_",
]  # fmt: skip


def causal_conv1d_triton(x_BTC, w_CK, pos_BT, activation="silu", backward=None):
    from kernels.conv.triton import causal_conv1d_triton as impl

    return impl(x_BTC, w_CK, pos_BT, activation, backward)


def causal_conv1d_state_triton(x_BTC, w_CK, pos_BT, seq_BT, state_NCW, activation="silu"):
    from kernels.conv.triton import causal_conv1d_state_triton as impl

    return impl(x_BTC, w_CK, pos_BT, seq_BT, state_NCW, activation)


def conv_state_step_(x_NC, state_PCW, slots_N, w_CK, silu: bool) -> torch.Tensor:
    if x_NC.is_cuda:
        from kernels.conv.triton import conv_state_step_triton_

        return conv_state_step_triton_(x_NC, state_PCW, slots_N, w_CK, silu)
    return conv_state_step_naive_(x_NC, state_PCW, slots_N, w_CK, silu)


def conv_state_steps_(xs_NC, states_PCW, slots_N, ws_CK, silu: bool) -> tuple[torch.Tensor, ...]:
    if xs_NC[0].is_cuda:
        from kernels.conv.triton import conv_state_steps_triton_

        return conv_state_steps_triton_(xs_NC, states_PCW, slots_N, ws_CK, silu)
    parts = zip(xs_NC, states_PCW, ws_CK, strict=True)
    return tuple(conv_state_step_naive_(x, st, slots_N, w, silu) for x, st, w in parts)
