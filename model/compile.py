"""Regional torch.compile: the element-wise regions of the model, each with an eager fallback.

Compiled: every ``RMSNorm`` and ``AttnResMix`` forward (an fp32 upcast, a reduction and a few
element-wise ops each: one fused kernel instead of five to ten) and each MoE's expert GLU (SiTU /
SiLU over the [rows, intermediate] buffer of the grouped path). Both wrap the ``model.fast``
dispatch, so with the "recompute" paths (ops "glu", "attn_res") the compiled region holds the
non-reentrant checkpoint and its recomputation; the fused Triton SiTU-GLU (CUDA default) is one
kernel already (should the compiler refuse it, that region runs eagerly). Not compiled: the KDA and conv
Triton kernels, the grouped GEMMs, attention and the LM head chunks, which already are single
kernels or bring their own. A region whose compilation (or compiled call) raises is switched to
eager for the rest of the process with one warning: a compiler problem never stops a run, and
``learner.compile=false`` is the switch for debugging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


class CompiledOrEager:
    """``torch.compile(fn)`` until it raises once, then ``fn`` itself."""

    def __init__(self, fn: Callable, name: str, backend: str | Callable = "inductor") -> None:
        self.eager, self.name = fn, name
        self.compiled = torch.compile(fn, backend=backend, dynamic=None)
        self.failed: str | None = None

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # a compiler failure of any kind: run the region eagerly instead
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("torch.compile of %s failed, running it eagerly: %s", self.name, self.failed)
        return self.eager(*args, **kwargs)


def compile_regions(model: nn.Module, backend: str | Callable = "inductor") -> list[CompiledOrEager]:
    """Wrap the element-wise regions of ``model`` in place; returns the wrappers (one per region)."""
    from model.attnres import AttnResMix
    from model.layers import RMSNorm
    from model.moe import SparseMoE

    regions = []
    for name, module in model.named_modules():
        if isinstance(module, (RMSNorm, AttnResMix)):
            module.forward = CompiledOrEager(module.forward, name, backend)
            regions.append(module.forward)
        elif isinstance(module, SparseMoE):
            first = module.experts[0]  # the grouped path applies expert 0's GLU to every expert's rows
            first.glu = CompiledOrEager(first.glu, f"{name}.experts.0.glu", backend)
            regions.append(first.glu)
    return regions
