"""What the host's CPUs did while a bench ran: a process's threads and every CPU, sampled from /proc (Linux).

A host-bound engine step moves with the speed of the one core its Python thread runs on. When the step's time
moves (bench/RESULTS.md: a rollout engine's decode step read 3.0 ms in some turns and 5.7 ms in others of one
run, every host phase alike), the first questions are about that thread: did it have its core to itself, did
it move between cores, did another thread of the process (a compile worker, an OpenMP pool) or the hypervisor
(steal time) take CPU from it? This samples, every ``interval`` seconds, each thread of ``pid`` (its CPU ticks
and the CPU it last ran on) and each CPU's busy and steal ticks, into JSON lines; ``windows`` then summarises
any time windows (a bench's turns) from them.

    python bench/host_sampler.py watch --pid PID --out samples.jsonl [--interval 0.1]
    python bench/host_sampler.py turns DIR/rollout_gpu.json samples.jsonl   # one row a reuse turn

``bench/rollout_gpu.py --host-samples`` runs ``watch`` on itself in a child process (a process of its own:
a thread would take the GIL from the thread it watches) and adds the reuse part's rows to its results.
What it cannot see: a CPU's clock, where the hypervisor does not expose it (a KVM guest's cpufreq), and
contention below the guest (other guests' load on the same cores or memory), which shows only as the watched
thread getting less done with its core to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads(pid: int) -> list[tuple[int, str, int, int]]:
    """(tid, name, user + system ticks, CPU it last ran on) for each thread of ``pid``; [] once it has exited."""
    rows = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return rows
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended in between
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on: utime is field 14, processor 39
        if int(tid) == pid and fields[0] in "ZX":  # exited, not reaped yet: gone as far as sampling goes
            return []
        rows.append((int(tid), name, int(fields[11]) + int(fields[12]), int(fields[36])))
    return rows


def cpus() -> dict[str, tuple[int, int]]:
    """CPU -> (user + nice + system ticks, steal ticks), from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and not line.startswith("cpu "):
            f = line.split()
            out[f[0][3:]] = (int(f[1]) + int(f[2]) + int(f[3]), int(f[8]) if len(f) > 8 else 0)
    return out


def sample(pid: int) -> dict:
    return {"t": round(time.time(), 3), "pid": pid, "threads": threads(pid), "cpus": cpus()}


def watch(pid: int, out: Path, interval: float = 0.1, limit_s: float | None = None) -> int:
    """Append a sample of ``pid`` to ``out`` every ``interval`` s until it exits (or ``limit_s``); returns the
    number of samples."""
    n, t0 = 0, time.monotonic()
    with open(out, "a") as f:
        while limit_s is None or time.monotonic() - t0 < limit_s:
            s = sample(pid)
            if not s["threads"]:
                break
            f.write(json.dumps(s) + "\n")
            f.flush()
            n += 1
            time.sleep(interval)
    return n


def load(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short when the watcher was stopped
            continue
    return rows


def window(samples: list[dict], start: float, end: float) -> dict | None:
    """The samples between two times: the watched process's main thread (its CPU share, the CPUs it ran on),
    its other threads that used more than 2% of a CPU, and the whole host's busy and steal CPUs. None when
    fewer than two samples fall inside."""
    inside = [s for s in samples if start <= s["t"] <= end]
    if len(inside) < 2:
        return None
    a, b = inside[0], inside[-1]
    dt = b["t"] - a["t"]
    before = {t[0]: t for t in a["threads"]}
    share = {t[0]: (t[2] - before[t[0]][2]) / TICKS / dt for t in b["threads"] if t[0] in before}
    main = b["pid"]
    other_shares = [(round(share.get(t[0], 0.0), 2), t[1]) for t in b["threads"] if t[0] != main]
    others = sorted((x for x in other_shares if x[0] > 0.02), reverse=True)
    ran_on = Counter(t[3] for s in inside for t in s["threads"] if t[0] == main)

    def host_cpus(field: int) -> float:  # CPUs' worth of busy (0) or steal (1) ticks over the window
        return sum(b["cpus"][c][field] - a["cpus"][c][field] for c in b["cpus"] if c in a["cpus"]) / TICKS / dt

    busy, steal = host_cpus(0), host_cpus(1)
    return {
        "main_share": round(share.get(main, 0.0), 2),
        "main_cpus": dict(sorted(ran_on.items())),
        "other_threads": others[:5],
        "host_busy_cpus": round(busy, 2),
        "host_steal_cpus": round(steal, 2),
    }


def turn_rows(turns_by_repeat: dict[str, list[list[dict]]], samples: list[dict]) -> list[dict]:
    """One row a turn of a reuse run (rows with ``ended_at`` and ``seconds``), in the order they ran: the
    turn's decode-step median beside ``window``'s summary of its time."""
    rows = []
    for mode, repeats in turns_by_repeat.items():
        for rep, turns in enumerate(repeats):
            for x in turns:
                if "ended_at" not in x:
                    continue
                start = x["ended_at"] - x["seconds"]
                rows.append({"mode": mode, "repeat": rep + 1, "turn": x["turn"], "start": start,
                             "seconds": round(x["seconds"], 3),
                             "step_median_ms": (x.get("steps") or {}).get("median_ms"),
                             "host": window(samples, start, x["ended_at"])})  # fmt: skip
    return sorted(rows, key=lambda r: r["start"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="sample a process until it exits")
    w.add_argument("--pid", type=int, required=True)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--interval", type=float, default=0.1)
    w.add_argument("--limit-s", type=float, default=None)
    t = sub.add_parser("turns", help="a reuse run's turns beside the samples")
    t.add_argument("results", type=Path, help="bench/rollout_gpu.py's rollout_gpu.json")
    t.add_argument("samples", type=Path)
    a = p.parse_args()
    if a.cmd == "watch":
        if not Path(f"/proc/{a.pid}").exists():
            sys.exit(f"no process {a.pid} (the watcher needs Linux /proc)")
        watch(a.pid, a.out, a.interval, a.limit_s)
        return
    turns = json.loads(a.results.read_text()).get("reuse", {}).get("turns_by_repeat")
    if not turns:
        sys.exit(f"{a.results}: no reuse turns_by_repeat (a reuse run of bench/rollout_gpu.py writes them)")
    for r in turn_rows(turns, load(a.samples)):
        print(f"{r['mode']:8s} repeat {r['repeat']} turn {r['turn']}: {r['seconds']:6.2f} s, decode step "
              f"{r['step_median_ms']} ms, host {r['host']}")


if __name__ == "__main__":
    main()
