"""bench/learner_memory.py on the CPU (fake tensors, no GPU): the predicted train-step memory counts the
parameters and the AdamW state to the byte, takes the CUDA code paths (the Triton KDA core's saved
tensors, varlen flash attention), and its peak lies in the backward, above the end of the forward."""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "learner_memory.py"


def _blocks(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def test_tiny_step_memory_counts_state_exactly_and_takes_cuda_paths(bench):
    from model import HybridConfig, HybridForCausalLM

    arch = bench.load_arch(ROOT / "configs/model/cpu_tiny.yaml")
    result = bench.measure(arch, 512)
    with torch.device("meta"):
        params = list(HybridForCausalLM(HybridConfig(**arch)).parameters())
    param_bytes = sum(_blocks(p.numel() * 4) for p in params)
    peak = result["at_peak"]["categories_gib"]
    assert round(peak["parameters"] * 2**30) >= param_bytes  # + the buffers (balancing bias)
    assert round(peak["parameters"] * 2**30) - param_bytes < 64 * 512
    # exp_avg and exp_avg_sq per parameter, and fused AdamW's fp32 step counter (one block each)
    assert round(peak["AdamW state"] * 2**30) == 2 * param_bytes + 512 * len(params)
    # the breakdown is taken in step 3 at step 2's peak event: the same allocations, up to a few cached
    # blocks of earlier steps (the KDA chunk plans' small index tensors)
    assert abs(result["peak_gib"] - result["at_peak"]["total_gib"]) * 2**30 < 16 * 512
    assert result["peak_phase"] == "backward" and result["peak_gib"] > result["forward_end"]["total_gib"]
    H, T = arch["linear_attn_config"]["num_heads"], 512
    saved = {(r["dtype"], r["shape"]) for r in result["forward_end"]["largest"]}
    assert ("float32", f"{T}x{H}x64") in saved  # the Triton KDA forward's Ainv, kept for its backward
    assert ("float32", f"{arch['num_attention_heads']}x{T}") in saved  # flash attention's logsumexp
