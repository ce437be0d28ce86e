"""bench/rollout_gpu.py's reuse bar over repeats: each repeat's session / none wall-time ratio, their median, and
the bar read on the median (a single run's ratio moves with the host by more than the bar's margin)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rollout_gpu.py"


def _rows(*seconds: float) -> list[dict]:
    return [{"seconds": s} for s in seconds]


def test_the_bar_reads_the_median_of_the_repeats_that_finished(bench):
    runs = {
        "session": SimpleNamespace(reps=[_rows(1.0, 1.0), _rows(1.0, 0.5), _rows(2.0, 1.0), _rows(1.0)]),
        "none": SimpleNamespace(reps=[_rows(3.0, 3.0), _rows(3.0, 3.0), _rows(4.0, 4.0)]),
    }
    out: dict = {}
    bench.repeat_speedup(out, runs, turns=2)
    assert out["speedup_vs_none_by_repeat"] == [3.0, 4.0, 8.0 / 3.0]  # the 4th repeat did not finish
    assert out["speedup_vs_none_median"] == 3.0
    summary = {"session": {"turns": 2, "later_computed_over_new": 1.004, "speedup_vs_none": 2.5},
               "none": {"turns": 2, "later_computed_over_new": 12.9}}  # fmt: skip
    assert bench.reuse_bar(summary, 2, out["speedup_vs_none_median"])["at_least_3x_vs_none"] is True
    assert bench.reuse_bar(summary, 2)["at_least_3x_vs_none"] is False  # one run: the last repeat's 2.5x
    two = {m: SimpleNamespace(reps=r.reps[:2]) for m, r in runs.items()}
    bench.repeat_speedup(out := {}, two, turns=2)
    assert out["speedup_vs_none_median"] == 3.5  # an even count: the middle two's mean, not the upper one
    bench.repeat_speedup(out := {}, {"session": runs["session"]}, turns=2)
    assert out == {}  # without the none mode there is no ratio


def test_a_profiled_timeline_is_written_as_a_gzipped_chrome_trace_with_its_steps_named(bench, tmp_path):
    import gzip
    import json

    import torch
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(2):
            with record_function(f"step {i}"):
                torch.ones(4, 4).matmul(torch.ones(4, 4))
    path = tmp_path / "turn_prefill.json.gz"
    bench._write_trace(prof, str(path))
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    steps = sorted(e["name"] for e in events if str(e.get("name", "")).startswith("step "))
    assert steps == ["step 0", "step 1"]
    assert any(e.get("name") == "aten::matmul" for e in events)


def test_the_results_count_the_slot_allocations_and_input_ids_the_fast_paths_answered(bench, monkeypatch):
    from rollout import vllm_compat

    monkeypatch.setattr(vllm_compat, "DECODE_ALLOC_COUNTS", {"fast": 7, "vllm": 2})
    monkeypatch.setattr(vllm_compat, "INPUT_IDS_COUNTS", {"fast": 5, "vllm": 1})
    saved = []
    out: dict = {"turns": {}}
    bench.reuse_results(SimpleNamespace(save=lambda: saved.append(True)), {}, out, turns=2)
    assert out["allocate_slots_calls"] == {"fast": 7, "vllm": 2} and saved == [True]
    assert out["input_ids_steps"] == {"fast": 5, "vllm": 1}


def test_a_watcher_that_stopped_early_keeps_the_rows_of_its_samples(bench, tmp_path):
    import json
    import subprocess
    import sys

    samples = [{"t": 100.0 + i, "pid": 7, "threads": [[7, "python3", 100 * i, 3]], "cpus": {"3": [100 * i, 0]}}
               for i in range(5)]  # fmt: skip
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in samples) + "\n")
    turns = {"session": [[{"turn": 1, "seconds": 2.0, "ended_at": 103.0, "steps": {"median_ms": 3.0}}]]}
    sampler = object.__new__(bench.HostSampler)
    sampler.path = path
    sampler.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('no /proc'); sys.exit(2)"],
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
    sampler.proc.wait(20)
    out = sampler.stop(turns)
    assert out["watcher_exited"] == "the watcher exited with 2: no /proc"
    assert len(out["rows"]) == 1 and out["rows"][0]["turn"] == 1 and out["rows"][0]["host"]["main_share"] == 1.0
