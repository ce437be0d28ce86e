"""Launch configs of the KDA Triton kernels: the search space, the tuned choice, and when to search.

Every kernel has a search space (``SPACE``: block sizes x num_warps x num_stages). Searching it costs
one compilation per config, about 4 s each on an H200, and the forward + backward offer ~96 configs
per dtype: measured 2026-12-01, a cold bf16 train step of gpu_1b spent 246 s in the autotuner
(``_offdiag_kernel`` alone 88 s, ``_main_bwd_kernel`` 67 s, ``_intra_bwd_kernel`` 45 s). So by default
a call compiles one config per kernel:

- fp32 I/O (the reference precision of checks and parity runs, never what is timed): the first config
  of the space, on every device;
- bf16 / fp16 on a GPU of a compute capability in ``TUNED``: the config the autotuner chose there over
  the whole space (recorded below with its provenance);
- bf16 / fp16 elsewhere: the whole space, searched once per (kernel, key) as before.

``LONGHORIZON_KDA_AUTOTUNE=1`` searches the whole space for bf16 / fp16 everywhere (to re-tune on a new
GPU or head size; ``TRITON_PRINT_AUTOTUNING=1`` prints the winners to copy into ``TUNED``). Under the
Triton interpreter every space is its first config (the interpreter would "benchmark" them all).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton

from kernels.kda.triton.common import INTERPRET

# kernel -> (block-size dicts, num_warps, num_stages); the config list is their product, in this order
SPACE: dict[str, tuple[list[dict], list[int], list[int]]] = {
    "_diag_kernel": ([{}], [1, 2, 4], [1, 2]),
    "_offdiag_kernel": ([{"BKO": 32}, {"BKO": 64}], [1, 2, 4], [1, 2, 3]),
    "_wy_kernel": ([{}], [4, 8], [1]),
    "_state_kernel": ([{"BV": 32}, {"BV": 64}, {"BV": 16}], [4, 8], [2, 3]),
    "_output_kernel": ([{"BV": 64}, {"BV": 128}], [4, 8], [2]),
    "_dav_kernel": ([{"BV": 64}, {"BV": 128}], [4, 8], [2]),
    "_state_bwd_kernel": ([{"BV": 32}, {"BV": 64}, {"BV": 16}], [4, 8], [2, 3]),
    "_main_bwd_kernel": (
        [
            {"BKF": 32, "BV": 64},
            {"BKF": 64, "BV": 64},
            {"BKF": 64, "BV": 32},
            {"BKF": 128, "BV": 32},
            {"BKF": 128, "BV": 64},
        ],
        [4, 8],
        [2, 3],
    ),
    "_intra_bwd_kernel": ([{"BKB": 32}, {"BKB": 64}, {"BKB": 128}], [2, 4], [1, 2, 3]),
}

# compute capability -> kernel -> (block sizes, num_warps, num_stages) chosen by the autotuner over the
# whole space for bf16 I/O. (9, 0): one NVIDIA H200, Triton 3.6.0, torch 2.11.0+cu130, gpu_1b's KDA
# shapes (H = 8, K = V = 128) on a 8192-token packed batch, 2026-12-01 (bench/learner_mfu.py's check).
TUNED: dict[tuple[int, int], dict[str, tuple[dict, int, int]]] = {
    (9, 0): {
        "_diag_kernel": ({}, 1, 1),
        "_offdiag_kernel": ({"BKO": 32}, 2, 3),
        "_wy_kernel": ({}, 4, 1),
        "_state_kernel": ({"BV": 16}, 4, 3),
        "_output_kernel": ({"BV": 128}, 4, 2),
        "_dav_kernel": ({"BV": 128}, 8, 2),
        "_state_bwd_kernel": ({"BV": 16}, 4, 3),
        "_main_bwd_kernel": ({"BKF": 64, "BV": 64}, 8, 2),
        "_intra_bwd_kernel": ({"BKB": 64}, 2, 3),
    }
}


def full_space(kernel: str) -> list[triton.Config]:
    blocks, warps, stages = SPACE[kernel]
    return [triton.Config(dict(b), num_warps=w, num_stages=n) for b in blocks for w in warps for n in stages]


def configs(kernel: str) -> list[triton.Config]:
    """The autotuner's config list for ``kernel`` (its first config alone under the interpreter)."""
    space = full_space(kernel)
    return space[:1] if INTERPRET else space


def _io_dtype(named_args: dict) -> torch.dtype | None:
    """The kernel's I/O dtype: that of W, Vn or q, whichever it takes (G and Ainv are fp32 always)."""
    io = next((named_args[n] for n in ("W", "Vn", "q") if n in named_args), None)
    return None if io is None else io.dtype


def _capability(named_args: dict) -> tuple[int, int] | None:
    t = next((v for v in named_args.values() if isinstance(v, torch.Tensor)), None)
    if t is None or t.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(t.device)


def choose(
    kernel: str, configs_: list, dtype: torch.dtype | None, capability: tuple[int, int] | None
) -> list:
    """The configs the autotuner may try (see the module docstring for the rules)."""
    if dtype == torch.float32:
        return configs_[:1]
    if os.environ.get("LONGHORIZON_KDA_AUTOTUNE", "0") not in ("", "0"):
        return configs_
    tuned = TUNED.get(capability, {}).get(kernel)
    if tuned is not None:
        blocks, warps, stages = tuned
        hit = [c for c in configs_ if (c.kwargs, c.num_warps, c.num_stages) == (blocks, warps, stages)]
        if hit:
            return hit[:1]
    return configs_


def prune(kernel: str) -> dict[str, Callable]:
    """``prune_configs_by`` of ``kernel``'s ``triton.autotune``."""

    def early_config_prune(configs_: list, named_args: dict, **kwargs) -> list:
        return choose(kernel, configs_, _io_dtype(named_args), _capability(named_args))

    early_config_prune.kernel = kernel
    return {"early_config_prune": early_config_prune}
