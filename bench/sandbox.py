"""Sandbox start-up cost and concurrency: calls per second for a trivial program, per backend.

Each backend (envs/sandbox.py: ``bwrap`` the strong one, ``unshare`` / ``none`` the weak ones) runs
``--calls`` trivial programs (``pass``) one after another and with ``--workers`` threads at once
(calls/s = calls / wall time; latency percentiles per call), then ``--concurrent`` calls of a small
program that prints a checked result, all started at once: every one must finish with the right
output (failures are counted and their reasons listed).

    python bench/sandbox.py                      # all backends, 2 workers, 32 concurrent
    python bench/sandbox.py --backends bwrap --concurrent 32 96
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from envs.sandbox import Sandbox, SandboxLimits

CHECKED = "import hashlib\nprint(hashlib.sha256(b'%d').hexdigest()[:12])"


def _expected(i: int) -> str:
    import hashlib

    return hashlib.sha256(str(i).encode()).hexdigest()[:12]


def _children_cpu() -> float:
    """CPU seconds of every reaped descendant: the sandbox's processes are reaped inside it and
    their time rolls up to the process we reap (the load-independent cost of a call)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def throughput(sandbox: Sandbox, calls: int, workers: int) -> dict:
    """calls/s and per-call latency for ``calls`` trivial programs over ``workers`` threads."""

    def one(_):
        t = time.monotonic()
        r = sandbox.run_python("pass")
        return time.monotonic() - t, r.ok

    start, cpu0 = time.monotonic(), _children_cpu()
    with ThreadPoolExecutor(workers) as pool:
        out = list(pool.map(one, range(calls)))
    wall, cpu = time.monotonic() - start, _children_cpu() - cpu0
    lat = sorted(t for t, _ in out)
    return {
        "calls": calls,
        "workers": workers,
        "calls_per_s": calls / wall,
        "cpu_ms_per_call": 1000 * cpu / calls,
        "p50_ms": 1000 * statistics.median(lat),
        "p90_ms": 1000 * lat[int(0.9 * (len(lat) - 1))],
        "failed": sum(1 for _, ok in out if not ok),
    }


def concurrent(sandbox: Sandbox, n: int) -> dict:
    """``n`` checked calls started at once; each must print its own expected line."""

    def one(i):
        r = sandbox.run_python(CHECKED % i)
        good = r.ok and r.stdout.strip() == _expected(i)
        return good, None if good else (r.reason or r.stderr.strip()[-200:] or f"exit {r.exit_code}")

    start = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        out = list(pool.map(one, range(n)))
    reasons = sorted({why for good, why in out if not good})
    return {
        "concurrent": n,
        "wall_s": time.monotonic() - start,
        "failed": sum(not g for g, _ in out),
        "reasons": reasons,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["bwrap", "unshare", "none"])
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--concurrent", type=int, nargs="+", default=[32])
    args = p.parse_args()
    print(f"# cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for backend in args.backends:
        sandbox = Sandbox(SandboxLimits(wall_s=60.0, cpu_s=10), backend=backend, allow_weak=True)
        sandbox.run_python("pass")  # warm the page cache
        for w in args.workers:
            row = {"backend": backend, **throughput(sandbox, args.calls, w), "load": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        for n in args.concurrent:
            row = {"backend": backend, **concurrent(sandbox, n), "load": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        "\n| backend | workers | calls/s | p50 ms | p90 ms | CPU ms/call | failed |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if "workers" in r:
            print(
                f"| {r['backend']} | {r['workers']} | {r['calls_per_s']:.1f} | {r['p50_ms']:.0f} | "
                f"{r['p90_ms']:.0f} | {r['cpu_ms_per_call']:.0f} | {r['failed']}/{r['calls']} |"
            )
    print("\n| backend | concurrent calls | wall s | failed |\n|---|---|---|---|")
    for r in rows:
        if "concurrent" in r:
            print(
                f"| {r['backend']} | {r['concurrent']} | {r['wall_s']:.2f} | {r['failed']} {r['reasons'] or ''} |"
            )


if __name__ == "__main__":
    main()
