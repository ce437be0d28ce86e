"""bench/learner_mfu.py --small on the CPU: the fast-vs-reference check passes and gates the timings,
a broken fast path stops the run before anything is timed, the report holds what the device run needs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "learner_mfu.py"



def run(bench, monkeypatch, out: Path, *extra: str) -> int:
    argv = ["learner_mfu.py", "--small", "--no-peer", "--tokens", "384", "--steps", "1", "--warmup", "0",
            "--out", str(out), *extra]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    return bench.main()


def test_small_run_checks_then_times(bench, monkeypatch, tmp_path):
    assert run(bench, monkeypatch, tmp_path) == 0
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    probes = {r["op"]: r for r in report["checks"] if r["kind"] == "op probe" and r["ok"]}
    assert {"moe", "lm_head"} <= set(probes)  # CPU: no Triton conv, no flash / flex backward
    (check,) = [r for r in report["checks"] if r["kind"] == "train step fast vs reference"]
    assert check["ok"] and check["dtype"] == "float32" and check["measured"]["grad_norm_rel"] <= 1e-3
    (row,) = report["runs"]
    assert row["tokens"] == 384 and row["tokens_per_s"] > 0 and row["mfu"] > 0
    assert "moe='grouped'" in row["fast_paths"] and "lm_head='chunked'" in row["fast_paths"]
    assert set(row["components"]) == {"kda", "mla", "moe", "lm_head_loss", "optimizer"}
    assert row["components"]["kda"]["layers"] == 3 and row["components"]["moe"]["layers"] == 3
    assert report["env"]["gemm_peak_tflops"] > 0
    assert "| 384 | ours |" in (tmp_path / "learner_mfu.md").read_text()


def _break_grouped_moe(monkeypatch):
    from model.moe import GroupedExperts

    real = GroupedExperts._grouped
    monkeypatch.setattr(GroupedExperts, "_grouped", lambda self, *args: 1.5 * real(self, *args))


def test_a_wrong_fast_op_is_rejected_by_the_probe_and_not_timed(bench, monkeypatch, tmp_path):
    _break_grouped_moe(monkeypatch)
    assert run(bench, monkeypatch, tmp_path) == 0
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    (probe,) = [r for r in report["checks"] if r.get("op") == "moe"]
    assert not probe["ok"] and probe["max_err_ratio"] > 0.1
    assert (
        report["env"]["fast_paths_used"]["moe"] == "loop" and "moe='loop'" in report["runs"][0]["fast_paths"]
    )


def test_a_wrong_train_step_stops_the_run_before_timing(bench, monkeypatch, tmp_path):
    _break_grouped_moe(monkeypatch)
    monkeypatch.setattr(bench, "probe_ops", lambda *a: "moe=grouped")  # as if the probe had missed it
    assert run(bench, monkeypatch, tmp_path) == 1
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    assert not report["checks"][-1]["ok"] and report["runs"] == []


def test_given_fast_paths_skip_the_probe_and_are_timed(bench, monkeypatch, tmp_path):
    """``--fast-paths`` (an A/B of one op on the device) is checked like the probe's pick, then timed."""
    monkeypatch.setattr(bench, "probe_ops", lambda *a: (_ for _ in ()).throw(AssertionError("probed")))
    assert run(bench, monkeypatch, tmp_path, "--fast-paths", "glu=recompute,moe=loop") == 0
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    assert report["env"]["fast_paths_spec"] == "glu=recompute,moe=loop"
    assert [r["ok"] for r in report["checks"] if r["kind"] == "train step fast vs reference"] == [True]
    assert "glu='recompute'" in report["runs"][0]["fast_paths"] and "moe='loop'" in report["runs"][0]["fast_paths"]


def test_also_fast_paths_checks_and_times_other_variants_in_the_same_process(bench, monkeypatch, tmp_path):
    """``--also-fast-paths`` (an A/B in one device call): each variant is checked against the references,
    then each is timed on the same batch, labelled by its fast paths."""
    monkeypatch.setattr(bench, "probe_ops", lambda *a: "moe=grouped")
    assert run(bench, monkeypatch, tmp_path, "--also-fast-paths", "moe=loop;attn_res=recompute") == 0
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    checks = [r for r in report["checks"] if r["kind"] == "train step fast vs reference"]
    assert [c["ok"] for c in checks] == [True, True, True] and "moe='loop'" in checks[1]["fast_paths"]
    assert "moe='grouped'" in checks[0]["fast_paths"] and "attn_res='recompute'" in checks[2]["fast_paths"]
    ours, variant, third = report["runs"]
    assert third["impl"] == "ours, attn_res=recompute" and "attn_res='recompute'" in third["fast_paths"]
    assert ours["impl"] == "ours" and "moe='grouped'" in ours["fast_paths"]
    assert variant["impl"] == "ours, moe=loop" and "moe='loop'" in variant["fast_paths"]
    assert variant["tokens"] == ours["tokens"] and variant["tokens_per_s"] > 0
    assert "| 384 | ours, moe=loop |" in (tmp_path / "learner_mfu.md").read_text()


def test_matmul_parameter_count_counts_active_experts_only(bench):
    from model import HybridConfig
    from model.modeling import HybridForCausalLM

    config = HybridConfig(**bench.SMALL_ARCH)
    model = HybridForCausalLM(config)
    n = bench.matmul_params(model, config.num_experts_per_token, config.num_experts)
    expert = 3 * config.moe_intermediate_size * config.routed_expert_hidden_size  # gate, up, down of one expert
    linear = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Linear")  # experts are not
    routers = sum(layer.block_sparse_moe.gate.weight.numel() for layer in model.model.layers if layer.is_moe)
    moe_layers = len(config.moe_layer_indices)
    assert n == linear + routers + config.num_experts_per_token * expert * moe_layers


def test_memory_breakdown_accounts_saved_bytes_per_mode(bench, monkeypatch, tmp_path):
    """--memory-breakdown: a ledger per mode and size, the a + b x tokens fit, and the recompute paths
    keep fewer bytes than plain autograd on the same ops, layer checkpointing fewer still."""
    assert run(bench, monkeypatch, tmp_path, "--tokens", "", "--skip-check", "--memory-breakdown",
               "--memory-tokens", "128,256", "--memory-episode", "64",
               "--memory-modes", "none-autograd,none,layer") == 0  # fmt: skip
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    fits = {r["checkpoint"]: r for r in report["memory"] if r["kind"] == "memory fit"}
    assert set(fits) == {"none-autograd", "none", "layer"}
    total = {k: v["total_at_target_gib"] for k, v in fits.items()}
    assert total["layer"] < total["none"] < 0.8 * total["none-autograd"]
    ledger = next(r for r in report["memory"] if r["kind"] == "memory" and r["checkpoint"] == "none")[
        "ledger"
    ]
    assert any(k.startswith("kda+moe layer / block_sparse_moe") for k in ledger["per_site_bytes"])
    assert "Saved for backward at 16384 tokens" in (tmp_path / "learner_mfu.md").read_text()


def test_optimizer_is_split_and_the_peer_runs_after_our_learner_is_released(bench, monkeypatch, tmp_path):
    """The optimizer component holds clip and AdamW apart with the host's dispatch time; the peer (the
    transformers model, torch fallbacks on the CPU) runs after all of our sizes, with our learner's
    parameters and optimizer state released first."""
    released = []
    real = bench.release_learner

    def spy(learner, cuda):
        params = list(learner.base_model.parameters())
        out = real(learner, cuda)
        released.append((learner.optimizer, all(p.numel() == 0 for p in params)))
        return out

    monkeypatch.setattr(bench, "release_learner", spy)
    argv = ["learner_mfu.py", "--small", "--tokens", "256", "--steps", "1", "--warmup", "0", "--no-probe",
            "--skip-check", "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    opt = report["runs"][0]["components"]["optimizer"]
    assert (
        opt["clip_s"] > 0
        and opt["adamw_s"] > 0
        and opt["host_dispatch_s"] > 0
        and opt["clip_foreach"] is True
    )
    assert opt["param_tensors"] == opt["with_grad"] > 100
    assert released == [(None, True)]
    peer = report["peer"][0]
    assert "error" in peer or peer["tokens"] == 256
    assert "optimizer" in (tmp_path / "learner_mfu.md").read_text()


def test_cuda_graphs_are_timed_after_the_plain_rows_and_mark_every_step(bench, monkeypatch, tmp_path):
    """``--cuda-graphs``: the learner's blocks compiled again with inductor's CUDA graphs (on the CPU inductor
    skips the graphs, the plumbing runs), a row "ours, cuda graphs (blocks)" after the plain one, each of its
    steps opened with ``cudagraph_mark_step_begin``, the ``--also-fast-paths`` A/B timed again there; the
    learner's own option named after it (``blocks,learner``) is on a CPU a note naming why, the rows before it
    standing; without ``--compile`` the flag is refused, and so is a mode that does not exist."""
    import pytest
    import torch

    import model.compile as mc

    built, marks = [], []
    real_init = mc.CompiledOrEager.__init__

    def record(self, fn, name, backend="inductor", options=None, dynamic=False):
        built.append((name, dict(options or {})))
        real_init(self, fn, name, backend, options, dynamic)

    monkeypatch.setattr(mc.CompiledOrEager, "__init__", record)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(bench, "probe_ops", lambda *a: "moe=grouped")
    args = ("--compile", "--compile-scope", "moe", "--cuda-graphs", "blocks,learner", "--no-components",
            "--also-fast-paths", "moe=loop")  # fmt: skip
    assert run(bench, monkeypatch, tmp_path, *args) == 0
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    assert [r["impl"] for r in report["runs"]] == [
        "ours", "ours, moe=loop", "ours, cuda graphs (blocks)", "ours, cuda graphs (blocks), moe=loop"]  # fmt: skip
    assert all(isinstance(r["graph_breaks"], dict) for r in report["runs"])  # dynamo's, by reason
    # the learner's own option, after the blocks: on a CPU a note naming why, the rows before it standing
    (note,) = [n for n in report["notes"] if "cuda graphs" in n]
    assert note.startswith("cuda graphs (learner)") and "needs the single-process learner on a CUDA device" in note
    graphed = {name for name, opts in built if opts.get("triton.cudagraphs")}
    assert graphed == {"sparse_moe_forward"}  # the blocks only, never the small regions
    assert len(marks) >= 3 and not bench.CUDA_GRAPHS["on"]  # warm-up (3) and the timed step
    with pytest.raises(SystemExit):
        run(bench, monkeypatch, tmp_path, "--cuda-graphs")
    with pytest.raises(SystemExit):  # a mode that does not exist is named when parsed
        run(bench, monkeypatch, tmp_path, "--compile", "--cuda-graphs", "blocks,whole")


def test_profile_graphs_writes_one_table_per_row(bench, monkeypatch, tmp_path):
    """``--profile --profile-graphs``: the plain row and the CUDA-graph row each profiled, each its own table
    file (the graph row's named after it), the kernel summary in the report's text naming the row."""
    monkeypatch.setattr(bench, "probe_ops", lambda *a: "moe=grouped")
    args = ("--compile", "--compile-scope", "moe", "--cuda-graphs", "blocks", "--no-components", "--profile",
            "--profile-graphs")  # fmt: skip
    assert run(bench, monkeypatch, tmp_path, *args) == 0
    report = json.loads((tmp_path / "learner_mfu.json").read_text())
    assert [r["impl"] for r in report["runs"]] == ["ours", "ours, cuda graphs (blocks)"]
    assert all("kernels_per_step" in r for r in report["runs"])
    tables = sorted(p.name for p in tmp_path.glob("profile_*.txt"))
    assert tables == ["profile_384.txt", "profile_384_cuda_graphs_blocks.txt"]
    assert all("Self CPU" in (tmp_path / t).read_text() for t in tables)


def test_gemm_peak_is_the_fastest_round(bench):
    """MFU's denominator: the best of the timed rounds (each several products back to back), so a round slowed
    by the clocks lowers nothing and MFU errs low rather than high."""
    times, calls = iter([3.0, 1.0, 2.0]), []

    class Rounds:
        def time(self, fn, reps, warmup):
            fn()
            calls.append((reps, warmup))
            return next(times)

    assert bench.gemm_peak(Rounds(), False, rounds=3, per_round=2) == 2 * 512**3 * 2 / 1.0
    assert calls == [(1, 0)] * 3


def test_device_idle_charges_each_gap_to_the_host_op_running_as_it_ended(bench):
    """Where the GPU waited: the wait before the first kernel, gaps between kernels (overlapping kernels merged,
    gaps under the threshold ignored), each charged to the innermost host op running at its end, runtime calls
    (launches) skipped, ranked by idle time."""
    kernels = [(10, 20), (15, 30), (35, 40), (100, 150), (150, 160), (400, 410), (600, 610)]
    host = [
        (0, 700, "step", "step"),
        (0, 95, "forward", "step"),
        (95, 500, "LogprobEntropyBackward", "step"),
        (99, 101, "cudaLaunchKernel", "step"),  # a launch: not the op to blame
        (390, 401, "aten::mm", "step"),
        (550, 650, "Optimizer.step", "step"),
        (599, 601, "cudaGraphLaunch", "step"),
    ]
    assert bench._union(kernels) == [(10, 30), (35, 40), (100, 160), (400, 410), (600, 610)]  # touching ones merge
    idle = bench.device_idle(kernels, host, min_gap_us=20.0, names=[f"k{i}" for i in range(len(kernels))])
    assert idle["before_first_kernel_ms"] == 10 / 1e3
    assert idle["gaps"] == 3 and abs(idle["in_gaps_ms"] - (60 + 240 + 190) / 1e3) < 1e-12  # 30..35 is under 20 us
    assert [(o["op"], o["gaps"]) for o in idle["by_host_op"]] == [("aten::mm", 1), ("Optimizer.step", 1),
                                                                  ("LogprobEntropyBackward", 1)]  # fmt: skip
    assert idle["by_host_op"][0]["outermost"] == "step"
    # the longest gaps first, each placed in the step: 160..400, 410..600, 40..100
    assert [(g["at_ms"], g["ms"]) for g in idle["longest"]] == [(0.16, 0.24), (0.41, 0.19), (0.04, 0.06)]
    assert idle["longest"][0] == {"at_ms": 0.16, "ms": 0.24, "began_in": "LogprobEntropyBackward / step",
                                  "ended_in": "aten::mm / step", "after_kernel": "k4", "before_kernel": "k5"}  # fmt: skip
    assert idle["longest"][2]["began_in"] == "forward / step" and idle["longest"][2]["before_kernel"] == "k3"
    line = bench.idle_line(idle)
    assert "GPU idle: 0.0 ms before the first kernel, 0.5 ms in 3 gaps" in line
    assert "0.24 ms at 0.2 ms (LogprobEntropyBackward / step -> aten::mm / step; after k4, before k5)" in line


def test_device_busy_reads_a_real_profile(bench):
    """``device_busy`` on a real profiler trace (CPU events standing in for kernels: this machine has no GPU): the
    events' attributes it reads exist, and the idle breakdown comes back with it."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        x = torch.randn(64, 64)
        for _ in range(3):
            x = (x @ x).tanh()
    busy = bench.device_busy(prof, kind=torch.autograd.DeviceType.CPU)
    assert busy["device_kernels"] > 0 and 0 < busy["device_busy_frac"] <= 1
    assert set(busy["device_idle"]) == {"before_first_kernel_ms", "in_gaps_ms", "gaps", "by_host_op", "longest"}
    assert all("after_kernel" in g for g in busy["device_idle"]["longest"])  # the kernels' names were passed
