"""The SiTU-GLU expert activation, h = [beta tanh(g/beta) sigmoid(g)] * [lb tanh(u/lb)] (fp32 math,
h in g's dtype), as one fused Triton kernel per direction (``triton.py``), with the PyTorch
reference beside it (``situ_glu_reference``, the same formula as ``model.layers.situ_glu``).

The fused kernel reads g and u (strided views of the grouped path's [P, 2I] gate/up buffer are
fine: only the last dim must be contiguous) and writes h; autograd keeps only g and u, and the
backward kernel recomputes tanh and sigmoid from them and writes dg and du. Against autograd on
the reference (which keeps six fp32 [P, I] intermediates and launches about twenty element-wise
kernels per direction) the only difference is rounding: the derivative is evaluated in the closed
form of ``triton.py``'s docstring, not op by op.

``GluActivation`` is a GLU activation (SiTU or SiLU) as a node that recomputes it calls it (the grouped
MoE's ``kernels.moe.glu_grouped_mm_combine``): values without an autograd graph and the closed-form
gradient, through the fused kernels or the PyTorch formulas (``situ_glu_with_grad_reference``,
``silu_glu_with_grad_reference``). A node built on it needs no autograd inside its forward or backward, so
``torch.compile`` traces it into the graph around it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def situ_glu_reference(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    g32, u32 = _f32(gate), _f32(up)
    h = beta * torch.tanh(g32 / beta) * torch.sigmoid(g32) * (linear_beta * torch.tanh(u32 / linear_beta))
    return h.to(gate.dtype)


def situ_glu_with_grad_reference(
    gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, dg, du): ``situ_glu_reference`` (the same ops, so the same h) and its gradient for the output
    gradient dh in the closed form of the fused backward kernel, sharing the tanh and sigmoid (fp32 math,
    each result rounded once to its input's dtype)."""
    g32, u32, dh32 = _f32(gate), _f32(up), _f32(dh)
    t1, s, t2 = torch.tanh(g32 / beta), torch.sigmoid(g32), torch.tanh(u32 / linear_beta)
    a, b = beta * t1, linear_beta * t2
    a_s = a * s
    dg = dh32 * b * (s * (1 - t1 * t1) + a_s * (1 - s))
    du = dh32 * a_s * (1 - t2 * t2)
    return (a_s * b).to(gate.dtype), dg.to(gate.dtype), du.to(up.dtype)


def silu_glu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(g) u in the inputs' dtype (``model.layers.silu_glu``)."""
    return torch.nn.functional.silu(gate) * up


def silu_glu_with_grad_reference(
    gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, dg, du): ``silu_glu_reference`` and its gradient, d silu(g) / dg = s (1 + g (1 - s)) with
    s = sigmoid(g) (fp32 math, each rounded once to its input's dtype)."""
    g32, u32, dh32 = _f32(gate), _f32(up), _f32(dh)
    s = torch.sigmoid(g32)
    dg = dh32 * u32 * s * (1 + g32 * (1 - s))
    return silu_glu_reference(gate, up), dg.to(gate.dtype), (dh32 * g32 * s).to(up.dtype)


@dataclass(frozen=True)
class GluActivation:
    """A GLU activation h = act(g, u) as values and a closed-form gradient, for nodes that recompute it.

    ``act``: "situ" (betas ``beta``, ``linear_beta``) or "silu". ``fused``: the Triton SiTU-GLU kernels
    (CUDA or the interpreter, "situ" only). ``fn``: what computes the values otherwise, a function of
    (g, u, act, beta, linear_beta) such as ``model.layers.glu_activation`` or a compiled region of it
    (default: the reference formulas). Frozen, so ``torch.compile`` treats it as a constant."""

    act: str = "situ"
    beta: float = 4.0
    linear_beta: float = 25.0
    fused: bool = False
    fn: Callable | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.act not in ("situ", "silu"):
            raise ValueError(f"GLU activation must be 'situ' or 'silu', got {self.act!r}")
        if self.fused and self.act != "situ":
            raise ValueError("the fused GLU kernels compute SiTU-GLU only")

    def values(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h, no autograd graph kept (the fused kernel's op is not differentiable)."""
        if self.fused:
            from kernels.glu.triton import situ_glu_values

            return situ_glu_values(gate, up, self.beta, self.linear_beta)
        if self.fn is not None:
            return self.fn(gate, up, self.act, self.beta, self.linear_beta)
        if self.act == "situ":
            return situ_glu_reference(gate, up, self.beta, self.linear_beta)
        return silu_glu_reference(gate, up)

    def values_and_grad(
        self, gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(h, dg, du) for the output gradient dh: the fused forward and backward kernels, or the reference
        formulas sharing their intermediates."""
        if self.fused:
            from kernels.glu.triton import situ_glu_grads, situ_glu_values

            h = situ_glu_values(gate, up, self.beta, self.linear_beta)
            return h, *situ_glu_grads(gate, up, dh, self.beta, self.linear_beta)
        if self.act == "situ":
            return situ_glu_with_grad_reference(gate, up, dh, self.beta, self.linear_beta)
        return silu_glu_with_grad_reference(gate, up, dh)


def situ_glu_fused(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """The Triton kernel (CUDA, or the interpreter): differentiable in gate and up."""
    from kernels.glu.triton import situ_glu_triton

    return situ_glu_triton(gate, up, beta, linear_beta)


__all__ = ["GluActivation", "silu_glu_reference", "silu_glu_with_grad_reference", "situ_glu_fused", "situ_glu_reference",
           "situ_glu_with_grad_reference"]
