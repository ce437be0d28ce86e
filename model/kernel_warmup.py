"""The KDA layer's Triton kernels compiled by a process of their own while an engine starts.

An engine's first prefill is where the KDA chunk kernels and the short convolutions' prefill kernels first
run: vLLM's profile step runs no recurrent layer (no attention metadata), so on the H200 the first request
JIT-compiled six KDA kernels one after the other, about 10 s of a first call of 72 s, after the profile step
and the CUDA-graph capture. Triton keeps what it compiles in its file cache (``TRITON_CACHE_DIR``), keyed by
a kernel's source, constants, argument dtypes and specialisation and the target GPU; none of those depend on
the number of tokens (our kernels take the sequence bounds as tensors). So one tiny prefill of one KDA layer,
with the engine's head sizes and dtypes, run by another process while the engine loads its weights and
compiles its regions, leaves every kernel of that prefill in the cache, and the engine loads them instead of
compiling them. Nothing depends on it finishing first: a kernel not yet in the cache compiles in the engine
as before.

    start_kda_warmup(config, dtype, device)   # the engine: a child process, or None (no GPU, no KDA layer)
    python -m model.kernel_warmup CONFIG.json DTYPE DEVICE   # the child: warm_kda_kernels, then exit

Off by default; ``LONGHORIZON_KERNEL_WARMUP=1`` turns it on. Measured on the H200 (bench/RESULTS.md, "Rollout
throughput", 2026-12-04): it did its part, the first request 11.7 -> 4-5 s, but the engine's weight loading,
which it overlaps, went 1.0 -> 12.9 and 20.6 s in two runs, so the first call was 62.4 and 63.3 s with it
against 51.0 s without. The suspect is the host's CPUs: the load is ~1,000 small CPU ops each parallel over
the engine's OpenMP threads, one per core, and a busy child on one of those cores stalls every barrier of
them (on the 2-core CPU machine a busy normal-priority process slowed such a loop 1.7x, the same process under
SCHED_IDLE not at all). So the child now runs with one thread under SCHED_IDLE (``yield_cpus``: only on CPUs
nothing else wants); that did not cure it: the next H200 run loaded the weights in 7.6 s beside it against 1.4
s without (first call 61.8 against 55.2 s), so the host's CPUs are not the whole cause and it stays off.
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
    unless ``LONGHORIZON_KERNEL_WARMUP=1``, on a CPU, and for a model without KDA layers. The child inherits the
    environment (the Triton cache directory with it) and reports a failure on stderr; the engine never
    depends on it."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("LONGHORIZON_KERNEL_WARMUP", "0") != "1":
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
