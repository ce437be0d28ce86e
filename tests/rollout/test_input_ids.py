"""rollout.vllm_compat's fast path for ``GPUModelRunner._prepare_input_ids`` (an async step's input ids): on
runner-shaped records with vLLM's own buffers (bench/input_ids.py's, which times the two) it writes the same input
ids as vLLM's method over batches that kept their order, were reordered, gained new requests or prefill chunks, or
lost requests; the cases it must leave to vLLM go to vLLM; the plugin installs it and its switch takes it out. The
async engine that runs it for real is tests/rollout/test_async_sessions.py's (its turns equal a recompute and the
learner)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout import vllm_compat
from rollout.vllm_compat import INPUT_IDS_COUNTS, fast_prepare_input_ids, install_input_ids

pytestmark = pytest.mark.vllm
BENCH = Path(__file__).resolve().parents[2] / "bench" / "input_ids.py"  # its records and vLLM's method


def _both(bench, counts: list[int], prev_rows: list[int], prev_tokens: torch.Tensor | None, spec: dict | None = None):
    """(vLLM's input ids, the fast path's, which path the fast one took) for one step."""
    counts_np, rows = np.array(counts, dtype=np.int32), np.array(prev_rows, dtype=np.int64)
    cu = np.cumsum(counts_np)
    host_ids = torch.randint(0, 1000, (int(cu[-1]),), dtype=torch.int32)
    sched = SimpleNamespace(scheduled_spec_decode_tokens=spec or {})
    vllm_runner, fast_runner = (bench.runner_records(rows, prev_tokens, host_ids) for _ in range(2))
    vllm_method = bench.vllm_method()
    vllm_method(vllm_runner, sched, len(counts), int(cu[-1]), cu)
    before = dict(INPUT_IDS_COUNTS)
    fast_prepare_input_ids(vllm_method)(fast_runner, sched, len(counts), int(cu[-1]), cu)
    took = next(k for k in INPUT_IDS_COUNTS if INPUT_IDS_COUNTS[k] != before[k])
    return vllm_runner.input_ids.gpu, fast_runner.input_ids.gpu, took


def _sampled(rows: int) -> torch.Tensor:
    return torch.randint(1000, 2000, (rows, 1), dtype=torch.int32)


@pytest.mark.parametrize(
    "counts, prev_rows",
    [
        ([1] * 64, list(range(64))),  # a decode step of an unchanged batch: the slice copy
        ([1] * 5, [3, 0, 4, 1, 2]),  # reordered: the scatter
        ([1, 1, 1], [0, 1, 2 + 3]),  # the last request moved up from a longer batch: the scatter
        ([1, 40, 1, 7], [0, -1, 1, -1]),  # new requests' prefill between decodes
        ([12, 1, 1], [0, 1, 2]),  # a prefill chunk that goes on, then decodes
        ([30, 9], [-1, -1]),  # nothing in common with the step before
    ],
)
def test_the_fast_path_writes_the_input_ids_vllms_method_writes(bench, counts, prev_rows):
    ours_vs_vllm = _both(bench, counts, prev_rows, _sampled(max(8, max(prev_rows) + 1)))
    assert ours_vs_vllm[2] == "fast"
    assert torch.equal(ours_vs_vllm[0], ours_vs_vllm[1])


def test_random_batches_agree_with_vllm(bench):
    gen = np.random.default_rng(0)
    for _ in range(200):
        R = int(gen.integers(1, 24))
        P = R + int(gen.integers(0, 6))
        counts = [int(gen.choice([1, 1, 1, gen.integers(2, 9)])) for _ in range(R)]
        rows = gen.permutation(P)[:R]
        rows[gen.random(R) < 0.3] = -1
        ours_vs_vllm = _both(bench, counts, rows.tolist(), _sampled(P))
        assert torch.equal(ours_vs_vllm[0], ours_vs_vllm[1]), (counts, rows)


def test_synchronous_steps_and_speculative_tokens_go_to_vllm(bench):
    assert _both(bench, [3, 1], [-1, 0], None)[2] == "vllm"  # no tokens left on the device: the synchronous scheduler
    spec = {"r1": [5, 6]}
    assert _both(bench, [1, 3], [0, 1], _sampled(4), spec)[2] == "vllm"


def test_the_plugin_installs_it_and_the_switch_takes_it_out(bench, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from rollout.vllm_plugin import register

    register()
    assert GPUModelRunner._prepare_input_ids.__wrapped__ is bench.vllm_method()
    try:
        assert install_input_ids("off") == "off"
        assert not hasattr(GPUModelRunner._prepare_input_ids, "__wrapped__")
        monkeypatch.setenv(vllm_compat.INPUT_IDS_ENV, "quick")
        with pytest.raises(ValueError, match="LONGHORIZON_INPUT_IDS must be one of"):
            install_input_ids()
    finally:
        install_input_ids("fast")
    assert GPUModelRunner._prepare_input_ids.__wrapped__ is bench.vllm_method()


def test_the_bench_times_both_on_the_same_records(bench):
    runner = bench.runner_records(np.arange(8), _sampled(8), torch.zeros(8, dtype=torch.int32))
    methods = (bench.vllm_method(), fast_prepare_input_ids(bench.vllm_method()))
    us = [bench.time_call(fn, runner, 8, 5) for fn in methods]
    assert all(t > 0 for t in us)
    assert torch.equal(runner.input_ids.gpu[:8], runner.input_batch.prev_sampled_token_ids[:8, 0])
