"""bench/learner_scaling.py --small on the CPU: the learner group at world sizes 1 and 2 (gloo, experts split
over the 2 ranks), its first step checked against world size 1's on the same global batch before timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "learner_scaling.py"

pytestmark = [pytest.mark.ray]


def test_small_run_checks_each_world_size_against_one_then_times_it(bench, ray_local, tmp_path):
    assert bench.main(["--small", "--expert-parallel", "2", "--steps", "1", "--out", str(tmp_path)]) == 0
    one, two = json.loads((tmp_path / "learner_scaling.json").read_text())["rows"]
    assert (one["world_size"], one["expert_parallel"], two["world_size"], two["expert_parallel"]) == (
        1,
        1,
        2,
        2,
    )
    assert one["status"] == two["status"] == "ok"
    assert two["tokens_per_step"] == 2 * one["tokens_per_step"] == 1024
    check = two["check"]  # world size 2 (ep 2) against world size 1 on the same 2 micro-batches
    assert check["ok"] and check["base_world_size"] == 1 and check["rel_tol"] == 1e-4
    assert check["grad_norm"] == pytest.approx(check["base_grad_norm"], rel=1e-4)
    for r in (one, two):
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s"]) and 0 < r["mfu"] < 1
    assert two["scaling_efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]))
    md = (tmp_path / "learner_scaling.md").read_text()
    assert "| small | 2 | 2 | 1024 |" in md and "(N=1): ok" in md
