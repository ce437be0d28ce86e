"""model/kernel_warmup.py: the child process that compiles the KDA prefill's Triton kernels while an engine
starts. Its point (kernels found in Triton's cache by the engine) needs a GPU and is measured there
(bench/rollout_throughput.py's start-up timeline); here: it runs the engine's prefill path, its command line
works and cleans up, a failure is reported and not raised, and nothing starts without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from model_cases import tiny_config

from model import kernel_warmup

ROOT = Path(__file__).resolve().parents[2]


def test_the_warm_up_runs_the_engines_kda_prefill(monkeypatch):
    """The chunked kernel (not the one-token recurrence) over several sequences, from initial states and
    returning the final ones: the call the engine's first prefill makes (``KDAStateLayer._run``)."""
    import kernels.kda

    calls = []
    chunk = kernels.kda.chunk_kda

    def recording(*args, **kw):
        calls.append(kw)
        return chunk(*args, **kw)

    monkeypatch.setattr(kernels.kda, "chunk_kda", recording)
    seconds = kernel_warmup.warm_kda_kernels(tiny_config(), torch.float32, "cpu")
    assert seconds > 0 and len(calls) == 1
    (kw,) = calls
    assert kw["initial_state"] is not None and kw["output_final_state"]
    assert kw["cu_seqlens"].tolist() == [0, *torch.tensor(kernel_warmup.WARMUP_LENGTHS).cumsum(0).tolist()]
    assert max(kernel_warmup.WARMUP_LENGTHS) > 64  # more than one chunk: every chunk kernel runs


def _child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model.kernel_warmup", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _spec(config) -> Path:
    spec = Path(tempfile.mkdtemp(prefix="lh_warmup_")) / "config.json"
    spec.write_text(json.dumps(config.to_dict(), default=str))
    return spec


def test_the_child_warms_up_and_removes_its_config():
    spec = _spec(tiny_config())
    done = _child(str(spec), "bfloat16", "cpu")
    assert done.returncode == 0, done.stderr
    assert not spec.parent.exists()


def test_a_failing_warm_up_says_so_and_exits_nonzero():
    spec = _spec(tiny_config())
    done = _child(str(spec), "bfloat17", "cpu")
    assert done.returncode == 1
    assert "kernel warm-up failed" in done.stderr and "bfloat17" in done.stderr
    assert _child().returncode == 2  # no arguments: the usage line


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_nothing_starts_without_a_gpu(device):
    assert kernel_warmup.start_kda_warmup(tiny_config(), torch.bfloat16, device) is None


def test_it_is_on_by_default_and_off_when_asked(monkeypatch):
    """On by default for a GPU device (the child's command names the engine's GPU and dtype; the child itself is
    not started here), none with LONGHORIZON_KERNEL_WARMUP=0 (returning before any CUDA call)."""
    started = []
    monkeypatch.setattr(kernel_warmup.subprocess, "Popen", lambda cmd, **kw: started.append((cmd, kw)) or "child")
    monkeypatch.delenv("LONGHORIZON_KERNEL_WARMUP", raising=False)
    assert kernel_warmup.start_kda_warmup(tiny_config(), torch.bfloat16, torch.device("cuda", 1)) == "child"
    (cmd, kw), = started
    assert cmd[1:3] == ["-m", "model.kernel_warmup"] and cmd[4:] == ["bfloat16", "cuda:1"]
    assert kw["env"]["OMP_NUM_THREADS"] == "1" and str(ROOT) in kw["env"]["PYTHONPATH"]
    spec = Path(cmd[3])
    assert json.loads(spec.read_text())["hidden_size"] == tiny_config().hidden_size
    spec.unlink()
    spec.parent.rmdir()
    monkeypatch.setenv("LONGHORIZON_KERNEL_WARMUP", "0")
    assert kernel_warmup.start_kda_warmup(tiny_config(), torch.bfloat16, "cuda") is None
    assert kernel_warmup.start_kda_warmup(tiny_config(), torch.bfloat16, torch.device("cuda", 0)) is None
    assert len(started) == 1


def test_the_child_yields_the_cpus():
    """One thread, and on Linux only the CPUs nothing else wants (the engine's weight load ran 10-25x slower
    beside a busy child on the H200's host)."""
    code = ("import os, torch; from model.kernel_warmup import yield_cpus; yield_cpus(); "
            "print(torch.get_num_threads(), os.sched_getscheduler(0) == os.SCHED_IDLE)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", str(sys.platform.startswith("linux"))]


def test_the_engine_starts_it_after_its_first_weight_load_only(monkeypatch):
    """The engine's model starts the child when its weights are in (it slowed the load it overlapped when it
    started with the model), and a later load (a weight update from the learner) starts none."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from rollout import vllm_model

    started = []
    monkeypatch.setattr(vllm_model, "start_kda_warmup", lambda *spec: started.append(spec) or f"child {len(started)}")
    model = SimpleNamespace(_warmup_spec=("config", torch.bfloat16, "cuda:0"), kernel_warmup=None)
    for _ in range(3):
        vllm_model.VllmHybridForCausalLM._start_kernel_warmup(model)
    assert started == [("config", torch.bfloat16, "cuda:0")] and model.kernel_warmup == "child 1"
