"""bench/rollout_throughput.py --small on the CPU: the whole plumbing (checkpoints, one child process per
engine, the fast-vs-eager greedy check, timed batches, the report rewritten per engine); the peer is
skipped without a GPU. Plus the pure parts: the plan parser, the first-mismatch report, and a child
process ended at its budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rollout_throughput.py"



def test_plan_parser(bench):
    assert bench.parse_plan("ours_eager:check,ours_fast,peer:time") == [
        ("ours_eager", ["check"]),
        ("ours_fast", ["check", "time"]),
        ("peer", ["time"]),
    ]
    with pytest.raises(ValueError, match="unknown engine 'ours'"):
        bench.parse_plan("ours:time")
    with pytest.raises(ValueError, match=r"unknown tasks \['timing'\]"):
        bench.parse_plan("peer:timing")
    # the start-up A/B of the kernel warm-up child in one call: the only engine of ours that turns it off
    assert bench.parse_plan("ours_fast:time,ours_fast_no_warmup:time")[1] == ("ours_fast_no_warmup", ["time"])
    assert [k for k, e in bench.ENGINES.items() if e.model == "ours" and not e.kernel_warmup] == ["ours_fast_no_warmup"]


def test_step_stats_tell_stalls_from_a_slow_batch(bench):
    """Step times from the steps' end times: the median, the longest, and the steps over 3x the median with
    what they took beyond it (a batch held up by one long step against one slow throughout)."""
    even = [i * 0.005 for i in range(11)]  # ten steps of 5 ms
    assert bench.step_stats(even) == {"steps": 11, "median_ms": 5.0, "max_ms": 5.0, "stalls": 0, "stall_extra_s": 0.0}
    stalled = [*even, even[-1] + 0.505]  # and one of 505 ms: 0.5 s beyond the median
    got = bench.step_stats(stalled)
    assert (got["median_ms"], got["max_ms"], got["stalls"], got["stall_extra_s"]) == (5.0, 505.0, 1, 0.5)
    assert bench.step_stats([1.0]) == {"steps": 1}


def test_profile_summary_counts_kernels_not_annotated_ranges(bench):
    """On a GPU the device time is the kernels': not the launching ops, nor a ``record_function`` range's device
    span (``gpu_user_annotation``), which covers kernels already counted."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(key, us, device, annotation=False):
        return SimpleNamespace(key=key, count=2, device_type=device, self_device_time_total=us,
                               self_cpu_time_total=us, is_user_annotation=annotation)  # fmt: skip

    events = [ev("gemm", 3000.0, DeviceType.CUDA), ev("norm", 1000.0, DeviceType.CUDA),
              ev("step 0", 3900.0, DeviceType.CUDA, annotation=True), ev("aten::mm", 50.0, DeviceType.CPU)]  # fmt: skip
    prof = SimpleNamespace(key_averages=lambda: events)
    got = bench.profile_summary(prof, {"steps": 2}, cuda=True)
    assert got["device_time_ms"] == 4.0 and got["per_step_ms"] == 2.0
    assert [t[0] for t in got["top"]] == ["gemm", "norm"]


def test_first_mismatch(bench):
    assert bench.first_mismatch([[1, 2, 3], [4]], [[1, 2, 3], [4]]) is None
    assert bench.first_mismatch([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {
        "prompt": 1, "position": 1, "got": 5, "reference": 6,
    }  # fmt: skip
    assert bench.first_mismatch([[1, 2]], [[1, 2, 3]])["position"] == 2


def test_a_child_past_its_budget_is_ended(bench):
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    t0 = time.monotonic()
    assert bench._wait(proc, timeout=1.0) == "killed at the budget, after 1 s"
    assert proc.poll() is not None and time.monotonic() - t0 < 20


def test_budget_shares_and_the_peer_fallback(bench, tmp_path, monkeypatch):
    """The parent's plan on a (pretend) GPU: each engine leaves RESERVE_S for later timing runs of ours_fast
    and the peer, and a peer that does not start is retried once with TRITON_MLA. The children stand in
    for engines that need a GPU; the checkpoints are tested in the end-to-end run below."""
    real_init = bench.Parent.__init__

    def gpu_parent(self, args):
        real_init(self, args)
        self.cuda = True

    calls = []

    def child(self, key, name, tasks, budget, backend=None):
        calls.append((key, tasks, budget, backend))
        if name == "peer" and backend is None:  # vLLM's own pick fails to start
            return {"error": "RuntimeError: no MLA backend for this latent", "process": {"status": "exit 1"}}
        return {"first_call_s": 1.0, "process": {"status": "exit 0"}}

    monkeypatch.setattr(bench.Parent, "__init__", gpu_parent)
    monkeypatch.setattr(bench.Parent, "child", child)
    # the budget clock starts before the environment report, whose first vLLM import can take seconds on a
    # loaded machine: out of the clock here, so that the budgets below are the plan's arithmetic alone
    monkeypatch.setattr(bench.rollout_gpu, "env_info", lambda: {"date": "test"})
    monkeypatch.setattr(
        bench, "build_checkpoints", lambda tmp, args, sz: {"ours": "o", "peer": "p", "vocab_size": 64}
    )
    assert bench.main(["--small", "--out", str(tmp_path), "--budget-s", "500"]) == 0
    assert [c[0] for c in calls] == ["ours_eager_fp32", "ours_fast_fp32", "ours_fast", "peer", "peer#triton_mla"]
    assert [c[3] for c in calls] == [None, None, None, None, "TRITON_MLA"]
    budgets = [c[2] for c in calls]  # RESERVE_S: ours_fast 150 s, the peer 300 s
    assert budgets[0] == pytest.approx(500 - 450, abs=5) and budgets[1] == pytest.approx(500 - 450, abs=5)
    assert budgets[2] == pytest.approx(500 - 300, abs=5)
    assert budgets[3] == pytest.approx(500, abs=5) and budgets[4] == pytest.approx(500, abs=5)
    res = json.loads((tmp_path / "rollout_throughput.json").read_text())
    assert "no MLA backend" in res["engines"]["peer"]["error"] and "peer#triton_mla" in res["engines"]


def test_child_env_carries_the_engine_switches_and_fp32_products_in_fp32(bench, monkeypatch):
    """An engine's switches reach its child; an fp32 engine's Triton dots without a precision (vLLM's Triton
    attention) and our KDA kernels' products run in IEEE fp32, not TF32 or bf16x3; a bf16 engine keeps the
    defaults."""
    from types import SimpleNamespace

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    monkeypatch.delenv("LONGHORIZON_KDA_FP32_PRODUCTS", raising=False)
    args = SimpleNamespace(engine_process="in", compile_threads=None)
    fp32 = bench.child_env(bench.ENGINES["ours_fast_fp32"], "float32", args, route_table=True)
    assert fp32["TRITON_F32_DEFAULT"] == "ieee" and fp32["LONGHORIZON_KDA_FP32_PRODUCTS"] == "ieee"
    assert fp32["LONGHORIZON_ROUTE_TABLE"] == "1"
    assert fp32["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and fp32["LONGHORIZON_KERNEL_WARMUP"] == "1"
    args.engine_process, args.compile_threads = "separate", 8
    bf16 = bench.child_env(bench.ENGINES["ours_graphs"], "bfloat16", args, route_table=False)
    assert not {"TRITON_F32_DEFAULT", "LONGHORIZON_KDA_FP32_PRODUCTS", "LONGHORIZON_ROUTE_TABLE"} & set(bf16)
    assert bf16["LONGHORIZON_COMPILE_BACKEND"] == "none" and bf16["LONGHORIZON_COMPILE_THREADS"] == "8"
    assert bf16["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_an_engine_named_twice_gets_a_second_key(bench, tmp_path, monkeypatch):
    """Children stand in for the engines: a plan that names an engine again runs it again, under "name#2"."""
    keys = []

    def child(self, key, name, tasks, budget, backend=None):
        keys.append((key, name, tasks))
        return {"process": {"status": "exit 0"}}

    monkeypatch.setattr(bench.Parent, "child", child)
    monkeypatch.setattr(bench, "build_checkpoints", lambda tmp, args, sz: {"ours": "o", "peer": "p", "vocab_size": 64})
    monkeypatch.setattr(bench.rollout_gpu, "env_info", lambda: {"date": "test"})
    assert bench.main(["--small", "--out", str(tmp_path), "--plan", "ours_eager:check,ours_fast:time,ours_eager:time"]) == 0
    assert keys == [("ours_eager", "ours_eager", ["check"]), ("ours_fast", "ours_fast", ["time"]),
                    ("ours_eager#2", "ours_eager", ["time"])]  # fmt: skip
    assert list(json.loads((tmp_path / "rollout_throughput.json").read_text())["engines"]) == [k for k, _, _ in keys]


def test_the_reported_pass_is_the_median_of_those_after_the_first(bench):
    rates = lambda *r: [{"generated_tok_s": x} for x in r]
    assert bench.median_pass(rates(5.0)) == 0  # one pass: that one
    assert bench.median_pass(rates(1.0, 9.0)) == 1  # two: the second (the first warms the batch size)
    assert bench.median_pass(rates(1.0, 13.0, 21.0, 14.0)) == 3  # 13, 21, 14: the median, 14
    assert bench.median_pass(rates(99.0, 13.0, 21.0)) == 1  # an even count: the lower middle


def test_passes_below_one_are_refused(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--small", "--passes", "0", "--out", str(tmp_path)])


def test_a_short_budget_is_split_in_proportion(bench):
    """What the reserve leaves when the budget covers it; a budget short of the reserves is split in
    proportion to them (330 s for ours_fast then the peer: 110 s and 220 s, not 45 s and 300 s)."""
    assert bench.engine_budget(500.0, 300.0, 150.0) == pytest.approx(200.0)
    assert bench.engine_budget(330.0, 300.0, 150.0) == pytest.approx(110.0)
    assert bench.engine_budget(220.0, 0.0, 300.0) == pytest.approx(220.0)  # the last engine: all that is left
    assert bench.engine_budget(40.0, 300.0, 150.0) == bench.MIN_CHILD_S


@pytest.mark.vllm
def test_a_failing_engine_is_a_result(bench, tmp_path, monkeypatch):
    """A child whose engine cannot start reports its error; the parent goes on to the next engine."""
    missing = str(tmp_path / "no_such_checkpoint")
    monkeypatch.setattr(
        bench, "build_checkpoints", lambda tmp, args, sz: {"ours": missing, "peer": missing, "vocab_size": 64}
    )
    assert bench.main(["--small", "--out", str(tmp_path), "--plan", "ours_eager:check,ours_fast:time"]) == 0
    engines = json.loads((tmp_path / "rollout_throughput.json").read_text())["engines"]
    assert list(engines) == ["ours_eager", "ours_fast"]
    for e in engines.values():
        assert e["process"]["status"] == "exit 1" and e["error"] and "first_call_s" not in e
    assert "| ours_eager | True | float32 | - |" in (tmp_path / "rollout_throughput.md").read_text()


@pytest.mark.vllm
@pytest.mark.slow
def test_small_run_end_to_end(bench, tmp_path):
    plan = "ours_eager:check+time,ours_fast:check+time+profile+profile_prefill,peer:time"  # every task
    # --warm-caches: the children share the run's compile caches (vLLM's CPU sampler compiles with inductor: ~20 s
    # a child from cold caches, which only the GPU bench's first-call numbers need)
    assert bench.main(["--small", "--keep", "--check-replay", "--warm-caches", "--plan", plan, "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "rollout_throughput.json").read_text())
    engines = res["engines"]
    assert list(engines) == ["ours_eager", "ours_fast", "peer"]
    assert "no GPU" in engines["peer"]["skipped"]
    for key in ("ours_eager", "ours_fast"):
        e = engines[key]
        assert "error" not in e, e.get("error")
        assert e["process"]["status"] == "exit 0" and e["enforce_eager"] is True  # the CPU: all eager
        assert 0 < e["engine_init_s"] <= e["first_call_s"] and e["kv_cache"]["capacity_tokens"] > 0
        # the first call's breakdown: vLLM's INFO records reach the probe (the engine reconfigures logging)
        startup = e["startup"]
        assert startup["vllm_log"] and startup["vllm_phases"].get("init_engine_s", -1) >= 0
        assert set(e["compile_end"]) == {"dynamo", "triton_jit", "regions"}
        assert e["compile_end"]["regions"] == {}  # eager: none of our regions compiled (each engine its own process)
    fast = engines["ours_fast"]
    check = fast["check"]
    assert {k: check[k] for k in ("equal", "first_mismatch", "prompts")} == {"equal": True, "first_mismatch": None, "prompts": 2}
    # --check-replay: the eager engine's routes replayed at every position from the fast one's device table
    # give its tokens and logprobs too, and the two engines' own routes are the same sets (on the CPU both
    # are eager)
    replayed = check["replayed"]
    assert {k: replayed[k] for k in ("equal", "first_mismatch", "routes_applied")} == {
        "equal": True, "first_mismatch": None, "routes_applied": True}  # fmt: skip
    assert replayed["logprob_max_abs"] < 1e-5 and len(replayed["prompts"]) == 2
    assert check["routes"]["other_sets"] == 0 and len(check["routes"]["prompts"]) == 2
    assert all(r["pairs"] > 0 for r in check["routes"]["prompts"])
    assert fast["greedy"] == engines["ours_eager"]["greedy"] and len(fast["greedy"][0]) == 8
    sizes = res["sizes"]
    for key in ("ours_fast", "ours_eager"):
        rows = engines[key]["timings"]
        assert set(rows) == {str(n) for n in sizes["concurrency"]}
        for n, row in rows.items():
            assert row["sequences"] == int(n) and row["prefill_tok_s"] > 0 and row["generated_tok_s"] > 0
            assert sizes["gen_min"] * int(n) <= row["generated_tokens"] <= sizes["gen_max"] * int(n)
            assert row["decode_tokens"] < row["generated_tokens"]
            steps = row["decode_steps"]  # the decode phase's step times and the collector's pauses, per batch
            assert steps["steps"] >= 2 and 0 < steps["median_ms"] <= steps["max_ms"]
            assert set(row["gc"]) == {"count", "s", "longest_s", "full_s"} and row["gc"]["s"] >= row["gc"]["full_s"]
            # the default four passes: the first warms the batch size, the row is the median of the other three
            others = row["other_passes"]
            assert sorted([o["pass"] for o in others] + [row["timed_pass"]]) == [1, 2, 3, 4]
            assert all(set(o) == {"pass", *bench.PASS_FIELDS} and o["generated_tok_s"] > 0 for o in others)
            later = sorted([o["generated_tok_s"] for o in others if o["pass"] > 1] + [row["generated_tok_s"]])
            assert row["timed_pass"] > 1 and row["generated_tok_s"] == later[1]
    # the same requests for every engine: identical prompt and generated token counts
    assert {n: r["prompt_tokens"] for n, r in engines["ours_fast"]["timings"].items()} == {
        n: r["prompt_tokens"] for n, r in engines["ours_eager"]["timings"].items()
    }
    assert res["summary"]["check"]["equal"] is True and res["summary"]["ours_fast_over_peer"] == {}
    assert res["summary"]["bar"]["first_call_lt_60s"] is True
    prof = fast["profile"]  # the profile task: one batch's decode steps
    assert prof["batch"]["sequences"] == bench.PROFILE_N
    assert prof["batch"]["generated_tokens"] == bench.PROFILE_N * bench.PROFILE_GEN
    # the profiled steps start once every sequence has its first token: decode only, one token a sequence
    assert 0 < prof["batch"]["decode_tokens"] <= bench.PROFILE_N * (bench.PROFILE_GEN - 1)
    assert prof["batch"]["decode_tokens"] <= bench.PROFILE_N * prof["batch"]["steps"]
    assert prof["per_step_ms"] > 0 and 25 <= len(prof["top"]) <= 60
    assert all(ms >= 0 and calls >= 1 for _, ms, calls in prof["top"])
    pre = fast["profile_prefill"]  # the prefill task: every step until each request has its first token
    assert pre["batch"]["sequences"] == bench.PROFILE_N and pre["batch"]["steps"] >= 1
    assert sizes["prompt_min"] * bench.PROFILE_N <= pre["batch"]["prompt_tokens"] <= sizes["prompt_max"] * bench.PROFILE_N
    assert pre["per_token_us"] > 0 and pre["top"]
    md = (tmp_path / "rollout_throughput.md").read_text()
    assert "prefill profile of ours_fast" in md
    assert "| ours_fast | 2 |" in md and "skipped: no GPU" in md and "profile of ours_fast" in md
    assert (
        json.loads(Path(res["checkpoints"]["peer"], "config.json").read_text())["model_type"] == "kimi_linear"
    )



@pytest.mark.vllm
def test_a_separate_engine_process_runs_the_time_task_only(bench, tmp_path, capsys):
    """--engine-process separate: the plan may time, not check or profile (those reach into the model, which
    then lives in the engine's own process); the timed batches run with the core in a process of its own."""
    with pytest.raises(SystemExit):
        bench.main(["--small", "--engine-process", "separate", "--plan", "ours_eager:check+time", "--out", str(tmp_path)])
    assert "runs the time task only; the plan also has ours_eager:check" in capsys.readouterr().err
    args = ["--small", "--engine-process", "separate", "--plan", "ours_eager:time", "--concurrency", "2", "--passes", "1",
            "--warm-caches"]  # fmt: skip
    before = _engine_core_processes()
    assert bench.main([*args, "--out", str(tmp_path)]) == 0
    e = json.loads((tmp_path / "rollout_throughput.json").read_text())["engines"]["ours_eager"]
    assert e["process"]["status"] == "exit 0" and e["engine_process"] == "separate"
    assert e["timings"]["2"]["generated_tokens"] > 0 and e["kv_cache"]["capacity_tokens"] > 0
    # the child ends with os._exit, which does not tear its engine core down: the parent ends its group
    assert _engine_core_processes() - before == set()


def _engine_core_processes() -> set[int]:
    """Live (not zombie) vLLM engine-core processes, by pid."""
    import psutil

    found = set()
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        text = " ".join([p.info["name"] or "", *(p.info["cmdline"] or [])])
        if "EngineCore" in text and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.add(p.pid)
    return found


def test_startup_line_lists_a_regions_compiles_by_frame():
    """The start-up line names each region's compiles and, where there were several, which frame each
    compiled ("frame/n": n > 0 is a recompile), so a slow start tells a recompile from a graph break."""
    sys.path.insert(0, str(BENCH.parent))
    import startup_probe

    res = {"first_call_s": 150.0, "engine_init_s": 140.0, "compile_end": {"regions": {
        "sparse_moe_forward": {"compiles": 2, "seconds": 79.4, "each": [("3/0", 41.0), ("3/1", 38.4)]},
        "rms_norm": {"compiles": 1, "seconds": 2.7, "each": [("5/0", 2.7)]},
    }}}  # fmt: skip
    line = startup_probe.breakdown_line(res)
    assert "sparse_moe_forward 2 x 79.4 s [3/0 41.0, 3/1 38.4]" in line
    assert "rms_norm 1 x 2.7 s," not in line and line.endswith("rms_norm 1 x 2.7 s")


def test_flip_gaps_place_each_prompts_first_changed_set(bench, tiny_ckpt, tmp_path):
    """After the engines, each check prompt's first token-layer with other experts (``check.routes``, hand-made
    here) gets the learner's selection gap there, from the checkpoint in fp32 and the reference's tokens
    (``route_ties.flip_gap``); prompts without one get none, and a failure is reported beside the routes."""
    import time
    from types import SimpleNamespace

    import numpy as np
    from route_ties import flip_gap

    path, model = tiny_ckpt
    parent = object.__new__(bench.Parent)
    parent.args, parent.t0, parent.cuda = SimpleNamespace(budget_s=600), time.monotonic(), False
    parent.save = lambda: None
    parent.sz = bench.Sizes(concurrency=[2], prompt_min=24, prompt_max=40, gen_min=4, gen_max=4, check_prompts=2,
                            check_gen=4, max_model_len=512, kv_bytes=64 << 20, dtype="float32")  # fmt: skip
    parent.ckpts = {"ours": str(path), "vocab_size": 1024}
    prompts = bench.check_prompts(parent.sz, 1024)
    generated = [np.array([7, 8, 9, 10]), np.array([11, 12, 13, 14])]
    np.savez(tmp_path / "ref.npz", t0=generated[0], t1=generated[1])
    first = [len(prompts[0]) + 2, 1]  # a generated position, the second MoE layer
    check = {"routes": {"prompts": [{"first": first}, {"first": None}]}}
    eager = {"dtype": "float32", "check_routes_file": str(tmp_path / "ref.npz")}
    parent.results = {"engines": {"ours_eager_fp32": eager, "ours_fast_fp32": {"dtype": "float32", "check": check}}}
    parent.flip_gaps()
    rows = check["routes"]["prompts"]
    assert rows[0]["first_gap"] == flip_gap(model.float(), [*prompts[0], *generated[0].tolist()], *first)
    assert 0 <= rows[0]["first_gap"]["quantile"] <= 1 and "first_gap" not in rows[1]
    assert f"{rows[0]['first_gap']['gap']:.1e}" in bench._gaps(check["routes"])  # the report's check column
    rows[0] = {"first": [len(prompts[0]) + 2, 99]}  # a layer the model does not have
    parent.flip_gaps()
    assert "MoE layer 99 outside" in check["routes"]["first_gaps_error"]
