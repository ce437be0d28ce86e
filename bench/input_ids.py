"""An async step's input ids: vLLM's ``GPUModelRunner._prepare_input_ids`` against the plugin's fast path
(``rollout.vllm_compat.fast_prepare_input_ids``), microseconds a call on runner-shaped records with vLLM's own
buffers (on the GPU when there is one), for a decode batch that kept its order and one that was reordered.

    python bench/input_ids.py [--requests 8,64,256] [--calls 2000]

Prints one row per case with both times and their ratio. The records are the ones tests/rollout/test_input_ids.py
checks the two against each other on (``runner_records``)."""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
import torch


def runner_records(prev_rows: np.ndarray, prev_tokens: torch.Tensor | None, host_ids: torch.Tensor,
                   device: torch.device | str = "cpu", size: int = 4096) -> SimpleNamespace:  # fmt: skip
    """The attributes ``_prepare_input_ids`` reads: the input-id and previous-row buffers (vLLM's CpuGpuBuffer, its
    "gpu" side on ``device``), the step before's sampled tokens, the batch's request ids."""
    from vllm.v1.utils import CpuGpuBuffer

    device = torch.device(device)
    pin = device.type == "cuda"
    ids = CpuGpuBuffer(size, dtype=torch.int32, device=device, pin_memory=pin)
    ids.cpu[: len(host_ids)] = host_ids
    ids.gpu.fill_(-7)  # what the step before left there
    prev = CpuGpuBuffer(size, dtype=torch.int64, device=device, pin_memory=pin)
    prev.np[: len(prev_rows)] = prev_rows
    batch = SimpleNamespace(prev_sampled_token_ids=prev_tokens, req_ids=[f"r{i}" for i in range(len(prev_rows))])
    return SimpleNamespace(input_batch=batch, prev_positions=prev, input_ids=ids, enable_prompt_embeds=False,
                           device=device, prev_num_spec_tokens=0, _draft_token_ids=None,
                           _pp_recv_work=None)  # fmt: skip


def vllm_method():
    """vLLM's own ``_prepare_input_ids`` (under the plugin's wrapper when it is installed)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = GPUModelRunner._prepare_input_ids
    return getattr(method, "__wrapped__", method)


def time_call(fn, runner, requests: int, calls: int) -> float:
    """Microseconds a call of ``fn`` on a decode step of ``requests`` requests (one token each)."""
    cu = np.arange(1, requests + 1, dtype=np.int32)
    sched = SimpleNamespace(scheduled_spec_decode_tokens={})
    for _ in range(20):
        fn(runner, sched, requests, requests, cu)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(runner, sched, requests, requests, cu)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    from rollout.vllm_compat import fast_prepare_input_ids

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="8,64,256")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vllm, fast = vllm_method(), fast_prepare_input_ids(vllm_method())
    print(f"device {device}; us a call, {a.calls} calls")
    print("| requests | batch | vLLM | fast path | ratio |\n|---|---|---|---|---|")
    for n in (int(x) for x in a.requests.split(",")):
        tokens = torch.randint(0, 1000, (n, 1), dtype=torch.int32, device=device)
        for case, rows in (("kept its order", np.arange(n)), ("reordered", np.random.default_rng(0).permutation(n))):
            runner = runner_records(rows, tokens, torch.zeros(n, dtype=torch.int32), device)
            us = [time_call(fn, runner, n, a.calls) for fn in (vllm, fast)]
            print(f"| {n} | {case} | {us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.1f}x |")


if __name__ == "__main__":
    main()
