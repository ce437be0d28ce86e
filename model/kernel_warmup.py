"""The KDA layer's Triton kernels compiled by a process of their own while an engine starts.

An engine's first prefill is where the KDA chunk kernels and the short convolutions' prefill kernels first
run: vLLM's profile step runs no recurrent layer (no attention metadata), so on the H200 the first request
JIT-compiled six KDA kernels one after the other, about 10 s of a first call of 72 s, after the profile step
and the CUDA-graph capture. Triton keeps what it compiles in its file cache (``TRITON_CACHE_DIR``), keyed by
a kernel's source, constants, argument dtypes and specialisation and the target GPU; none of those depend on
the number of tokens (our kernels take the sequence bounds as tensors). So one tiny prefill of one KDA layer,
with the engine's head sizes and dtypes, run by another process while the engine compiles its regions and
captures its graphs, leaves every kernel of that prefill in the cache, and the engine loads them instead of
compiling them. Nothing depends on it finishing first: a kernel not yet in the cache compiles in the engine
as before.

    start_kda_warmup(config, dtype, device)   # the engine: a child process, or None (no GPU, no KDA layer)
    python -m model.kernel_warmup CONFIG.json DTYPE DEVICE   # the child: warm_kda_kernels, then exit

On by default on a GPU; ``LONGHORIZON_KERNEL_WARMUP=0`` turns it off. The engine starts it once its weights
are in (``rollout.vllm_model``), so it overlaps the region compiles and the CUDA-graph capture. Started with
the model, as first tried, it slowed the weight load it overlapped 1.0 -> 7.6-20.6 s on the H200 (single-threaded
under SCHED_IDLE too, ``yield_cpus``), more than it saved. Started after the load (bench/RESULTS.md, "Rollout
throughput", 2026-12-04): weights loaded in 1.1 s with it as without, its six kernels came from the cache in the
engine, and the first request took 4.8 s after the engine was up against 13.9 s without it (first call 52.2
against 57.7 s, one run each on one machine).

vLLM-free: the child imports torch and our model only.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# a prefill of two sequences, one longer than a 64-token chunk: every kernel of the chunked path and the
# varlen convolutions run (a one-token prompt would take the step recurrence instead)
WARMUP_LENGTHS = (80, 48)


def warm_kda_kernels(config, dtype: torch.dtype, device: torch.device | str) -> float:
    """One prefill of one KDA layer (random weights) over ``WARMUP_LENGTHS``, as the engine's prefill calls
    it (``rollout.vllm_layers.KDAStateLayer``: the learner's module on flattened tokens, starting from the
    slots' states and returning the new ones), in inference mode; returns its seconds."""
    from model.cache import KDAState
    from model.kda import KimiDeltaAttention
    from model.layers import seq_layout
    from model.serving import kda_state_dtypes, kda_state_shapes

    t0 = time.perf_counter()
    device = torch.device(device)
    layer = next(i for i in range(config.num_hidden_layers) if config.is_kda_layer(i))
    with torch.device(device):
        kda = KimiDeltaAttention(config, layer).to(dtype).eval()
    N, T = len(WARMUP_LENGTHS), sum(WARMUP_LENGTHS)
    conv_q, conv_k, conv_v, rec = (
        torch.zeros(N, *shape, dtype=dt, device=device)
        for shape, dt in zip(kda_state_shapes(config), kda_state_dtypes(dtype))
    )
    state = KDAState(rec, conv_q, conv_k, conv_v)
    cu = torch.tensor([0, *torch.tensor(WARMUP_LENGTHS).cumsum(0).tolist()], dtype=torch.long, device=device)
    x = torch.randn(1, T, config.hidden_size, dtype=dtype, device=device)
    with torch.inference_mode():
        kda(x, seq_layout(1, T, cu, device), cu_seqlens=cu, state=state, return_state=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def start_kda_warmup(config, dtype: torch.dtype, device: torch.device | str) -> subprocess.Popen | None:
    """Start ``warm_kda_kernels`` in a child process on the same GPU and return it (not waited for); None
    with ``LONGHORIZON_KERNEL_WARMUP=0``, on a CPU, and for a model without KDA layers. The child inherits the
    environment (the Triton cache directory with it) and reports a failure on stderr; the engine never
    depends on it."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("LONGHORIZON_KERNEL_WARMUP", "1") == "0":
        return None
    if not any(config.is_kda_layer(i) for i in range(config.num_hidden_layers)):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    spec = Path(tempfile.mkdtemp(prefix="lh_warmup_")) / "config.json"
    spec.write_text(json.dumps(config.to_dict(), default=str))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "model.kernel_warmup", str(spec), str(dtype).removeprefix("torch."), f"cuda:{index}"]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def yield_cpus() -> None:
    """This process on one thread, scheduled only where a CPU is otherwise idle (Linux's SCHED_IDLE; the
    thread count alone elsewhere): the engine it runs beside keeps its cores."""
    torch.set_num_threads(1)
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: normal priority
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main(argv: list[str]) -> int:
    from model.config import HybridConfig

    yield_cpus()

    if len(argv) != 3:
        print("usage: python -m model.kernel_warmup CONFIG.json DTYPE DEVICE", file=sys.stderr)
        return 2
    path, dtype_name, device = argv
    try:
        config = HybridConfig.from_dict(json.loads(Path(path).read_text()))
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype: {dtype_name!r}")
        warm_kda_kernels(config, dtype, device)
    except Exception as e:  # the engine goes on without it: say why, once
        print(f"longhorizon kernel warm-up failed ({type(e).__name__}: {e}); the engine compiles its kernels "
              "itself", file=sys.stderr)  # fmt: skip
        return 1
    finally:
        if Path(path).name == "config.json" and Path(path).parent.name.startswith("lh_warmup_"):
            Path(path).unlink(missing_ok=True)
            Path(path).parent.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
