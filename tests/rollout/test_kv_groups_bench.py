"""bench/kv_groups.py on the CPU with the smallest sizes: the layer pattern's groups per depth, the timed calls
counted, the same greedy tokens, the report written; and its pieces (the timer, the median pass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kv_groups.py"


def test_call_timer_counts_and_restores(bench):
    class Thing:
        def work(self, x):
            return x + 1

    real = Thing.work
    timer = bench.CallTimer([(Thing, "work")])
    assert Thing.work is not real and Thing().work(1) == 2 and Thing().work(2) == 3
    assert timer.calls["work"] == 2 and timer.seconds["work"] >= 0.0
    timer.reset()
    assert timer.calls == {}
    timer.restore()
    Thing().work(3)
    assert timer.calls == {} and Thing.work is real


def test_median_pass_leaves_out_the_warm_up(bench):
    passes = [{"schedule_ms_per_step": x} for x in (9.0, 3.0, 1.0, 2.0)]
    assert bench.median_pass(passes)["schedule_ms_per_step"] == 2.0  # of 3, 1, 2
    assert bench.median_pass(passes[:1])["schedule_ms_per_step"] == 9.0  # one pass: that one


def test_bad_depths_are_named(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--depths", "1,deep"])
    assert "--depths: 'auto' or ints" in capsys.readouterr().err


@pytest.mark.vllm
def test_small_run_compares_the_depths(bench, tmp_path):
    argv = ["--out", str(tmp_path), "--preset", "cpu_tiny", "--sequences", "3", "--gen", "3", "--passes", "2",
            "--rounds", "1"]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "kv_groups.json").read_text())
    assert res["model"] == {"layers": 4, "kda_layers": 3, "mla_layers": 1}
    s = res["summary"]
    assert (s["1"]["groups"], s["auto"]["groups"]) == (4, 2)
    assert s["1"]["schedule_vs_first"] == 1.0 and s["auto"]["greedy_equal_first"] is True
    for depth in ("1", "auto"):
        (passes,) = res["depths"][depth]["rounds"]
        assert len(passes) == 2 and all(p["steps"] >= 2 and p["allocate_slots_calls"] >= 3 for p in passes)
        assert all(p["tokens"] <= 9 and p["schedule_ms_per_step"] > 0 for p in passes)
        groups = 3 if depth == "1" else 1  # KDA groups: one metadata build each a step
        assert all(p["kda_metadata_builds"] >= groups * p["steps"] - groups for p in passes)
