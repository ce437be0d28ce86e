"""bench/host_sampler.py: a real process watched through /proc (its threads' CPU ticks and cores, the host's CPUs),
and a reuse run's turns lined up with the samples."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_sampler.py"

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="the sampler reads Linux /proc")

# a main thread that spins and a second, named thread that sleeps
_CHILD = """
import threading, time
threading.Thread(target=time.sleep, args=(30,), name="idle", daemon=True).start()
end = time.time() + 30
while time.time() < end:
    pass
"""


def test_watch_follows_a_process_until_it_exits(bench, tmp_path):
    """Two threads seen in every sample, the spinning one's ticks growing on one of the host's cores, the
    sleeping one not listed as busy; the watcher ends when the process does."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD])
    try:
        time.sleep(0.3)  # its second thread started
        out = tmp_path / "samples.jsonl"
        watcher = subprocess.Popen(
            [sys.executable, str(BENCH), "watch", "--pid", str(child.pid), "--out", str(out), "--interval", "0.05"]
        )
        time.sleep(1.5)
        child.kill()  # not reaped yet: a zombie, which counts as gone
        assert watcher.wait(timeout=20) == 0  # it stops by itself
    finally:
        child.kill()
        child.wait()
    samples = bench.load(out)
    assert len(samples) >= 5
    first, last = samples[0], samples[-1]
    assert {len(s["threads"]) for s in samples} == {2} and first["pid"] == child.pid
    main = {t[0]: t for t in last["threads"]}[child.pid]
    assert main[2] > {t[0]: t for t in first["threads"]}[child.pid][2]  # the spinning thread's ticks grew
    assert str(main[3]) in last["cpus"]  # the core it ran on is one of the host's
    w = bench.window(samples, first["t"], last["t"])
    assert set(w) == {"main_share", "main_cpus", "other_threads", "host_busy_cpus", "host_steal_cpus"}
    assert sum(w["main_cpus"].values()) == len(samples) and w["main_share"] > 0
    assert all(name != "idle" for _, name in w["other_threads"])  # a sleeping thread is not listed as busy
    assert bench.window(samples, last["t"] + 1, last["t"] + 2) is None  # no samples there


def test_turn_rows_line_turns_up_with_their_samples(bench, tmp_path):
    tick = bench.TICKS

    def s(t: float, main_ticks: int, other_ticks: int) -> dict:
        threads = [[7, "python3", main_ticks, 3], [8, "worker", other_ticks, 5]]
        return {"t": t, "pid": 7, "threads": threads, "cpus": {"3": [main_ticks, 0], "5": [other_ticks, t * tick]}}

    samples = [s(100.0 + 0.5 * i, int(0.5 * i * tick), int(0.25 * i * tick)) for i in range(9)]  # 100.0 .. 104.0 s
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in samples) + '\n{"t": 10')  # a last line cut short
    assert len(bench.load(path)) == 9
    turns = {
        "session": [[{"turn": 1, "seconds": 2.0, "ended_at": 102.0, "steps": {"median_ms": 3.1}}]],
        "none": [[{"turn": 1, "seconds": 2.0, "ended_at": 104.0, "steps": {"median_ms": 4.2}}, {"turn": 2}]],
    }
    rows = bench.turn_rows(turns, bench.load(path))
    assert [(r["mode"], r["turn"], r["step_median_ms"]) for r in rows] == [("session", 1, 3.1), ("none", 1, 4.2)]
    host = rows[0]["host"]
    assert host["main_share"] == pytest.approx(1.0) and host["main_cpus"] == {3: 5}
    assert host["other_threads"] == [(0.5, "worker")]
    assert host["host_busy_cpus"] == pytest.approx(1.5) and host["host_steal_cpus"] == pytest.approx(1.0)
