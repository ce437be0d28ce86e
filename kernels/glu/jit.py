"""The SiTU-GLU activation as Triton device functions: what the GLU kernels (``kernels.glu.triton``) and the
rollout engine's fused expert kernel (``kernels.moe.triton._situ_gmm_groups``) evaluate. No op is registered here,
so the tests may import this module afresh for the interpreter beside either of them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh in fp32 to a few ulp without libdevice (the interpreter has none): an odd series below
    |x| = 0.2 (where 1 - exp(-2|x|) would cancel), (1 - e) / (1 + e) with e = exp(-2|x|) above."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.2, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def situ(g, u, beta, inv_beta, lb, inv_lb):
    """h = [beta tanh(g / beta) sigmoid(g)] [lb tanh(u / lb)] in fp32 (the arguments as products with the
    reciprocals)."""
    a = beta * tanh(g * inv_beta)
    s = 1.0 / (1.0 + tl.exp(-g))  # not tl.sigmoid: the interpreter cannot run it
    b = lb * tanh(u * inv_lb)
    return a * s * b
