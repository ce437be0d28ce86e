"""Triton KDA kernels: `chunk_kda_triton` (training/prefill, with backward) and
`fused_recurrent_kda_triton` (decode, state updated in place by index), `pool_decode_step_triton`
(decode tokens on a state pool of any layout; what `kernels.kda.kda_decode_step_` runs on CUDA).

Import-light: triton and the kernels load on first attribute access, so that setting
TRITON_INTERPRET before that access is enough to run them in the interpreter.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "chunk_kda_triton": "kernels.kda.triton.chunk",
    "fused_recurrent_kda_triton": "kernels.kda.triton.decode",
    "pool_decode_step_triton": "kernels.kda.triton.decode",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
