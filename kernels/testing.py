"""Test helpers for kernels: error ratios against a reference, NaN-poisoned allocations, and Triton
modules imported for the interpreter.

Imports only torch, so model and kernel tests alike can use it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import torch

log = logging.getLogger(__name__)


def import_interpreted(*names: str) -> list[ModuleType]:
    """The modules ``names`` imported afresh with TRITON_INTERPRET=1 (Triton reads it when a kernel is
    decorated, so a module another test loaded for a GPU is dropped first); the variable is put back."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in names:
            sys.modules.pop(name, None)
        return [importlib.import_module(name) for name in names]
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def error_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||ref - out|| / ||ref|| in float64 (0 when both are exactly zero)."""
    ref64, out64 = ref.detach().double(), out.detach().double()
    num, den = (ref64 - out64).norm().item(), ref64.norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> float:
    """Assert the RMS error ratio ||ref - out|| / ||ref|| <= ratio; log it and the max abs diff.

    Also asserts that ``out`` has ref's shape and holds no NaN or Inf. Returns the ratio.
    """
    if out is None or ref is None:
        raise AssertionError(f"{name}: missing tensor (ref {ref is None}, out {out is None})")
    assert tuple(out.shape) == tuple(ref.shape), f"{name}: shape {tuple(out.shape)} != ref {tuple(ref.shape)}"
    out_bad = int((~torch.isfinite(out.detach())).sum())
    assert out_bad == 0, f"{name}: {out_bad} non-finite values in the output"
    ref_bad = int((~torch.isfinite(ref.detach())).sum())
    assert ref_bad == 0, f"{name}: {ref_bad} non-finite values in the reference"
    err = error_ratio(ref, out)
    max_diff = (ref.detach().double() - out.detach().double()).abs().max().item() if ref.numel() else 0.0
    msg = f"{name}: err ratio {err:.3e} (limit {ratio:.1e}), max abs diff {max_diff:.3e}"
    log.info(msg)
    assert err <= ratio, msg
    return err


def assert_within_ulps(name: str, ref: torch.Tensor, out: torch.Tensor, ulps: int) -> None:
    """Assert every element of ``out`` within ``ulps`` units in the last place of ``ref``'s element, in ref's
    (half) dtype: the check for a kernel that rounds as its reference does but, under the interpreter, toward
    zero (a GPU rounds to nearest)."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != ref {tuple(ref.shape)}"
    ulp = 2.0 ** torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) * torch.finfo(ref.dtype).eps
    diff = (out.float() - ref.float()).abs()
    worst = float((diff / ulp).max()) if ref.numel() else 0.0
    assert bool((diff <= ulps * ulp).all()), f"{name}: {worst:.1f} ulps off (limit {ulps})"


def _poisoned(fn, only_prefixes: tuple[str, ...] | None):
    """Wrap an allocator so floating results called from the given modules are filled with NaN."""

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if only_prefixes is not None:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith(only_prefixes):
                return out
        if isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()):
            with torch.no_grad():
                out.fill_(float("nan"))
        return out

    wrapper.__wrapped__ = fn
    return wrapper


@contextlib.contextmanager
def nan_poisoned_empty(only_prefixes: tuple[str, ...] | None = ("kernels", "model")) -> Iterator[None]:
    """Make torch.empty / empty_like / Tensor.new_empty return NaN-filled floating tensors.

    A path that reads memory it never wrote then produces NaN instead of passing by luck, the
    way flash-linear-attention's tests poison fresh allocations. ``only_prefixes`` limits the
    poisoning to calls made from those modules (None: every caller).
    """
    saved = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
    torch.empty = _poisoned(saved[0], only_prefixes)
    torch.empty_like = _poisoned(saved[1], only_prefixes)
    torch.Tensor.new_empty = _poisoned(saved[2], only_prefixes)
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = saved
