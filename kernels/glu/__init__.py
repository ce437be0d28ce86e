"""The SiTU-GLU expert activation, h = [beta tanh(g/beta) sigmoid(g)] * [lb tanh(u/lb)] (fp32 math,
h in g's dtype), as one fused Triton kernel per direction (``triton.py``), with the PyTorch
reference beside it (``situ_glu_reference``, the same formula as ``model.layers.situ_glu``).

The fused kernel reads g and u (strided views of the grouped path's [P, 2I] gate/up buffer are
fine: only the last dim must be contiguous) and writes h; autograd keeps only g and u, and the
backward kernel recomputes tanh and sigmoid from them and writes dg and du. Against autograd on
the reference (which keeps six fp32 [P, I] intermediates and launches about twenty element-wise
kernels per direction) the only difference is rounding: the derivative is evaluated in the closed
form of ``triton.py``'s docstring, not op by op.
"""

from __future__ import annotations

import torch


def situ_glu_reference(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    g32, u32 = (x if x.dtype in (torch.float32, torch.float64) else x.float() for x in (gate, up))
    h = beta * torch.tanh(g32 / beta) * torch.sigmoid(g32) * (linear_beta * torch.tanh(u32 / linear_beta))
    return h.to(gate.dtype)


def situ_glu_fused(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """The Triton kernel (CUDA, or the interpreter): differentiable in gate and up."""
    from kernels.glu.triton import situ_glu_triton

    return situ_glu_triton(gate, up, beta, linear_beta)


__all__ = ["situ_glu_fused", "situ_glu_reference"]
