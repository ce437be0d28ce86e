"""Helpers of scripts/ray_local.sh: free ports for a local Ray cluster, and stopping only that cluster.

    python scripts/ray_local.py ports N        # N distinct free TCP ports on 127.0.0.1, one line
    python scripts/ray_local.py pids TEMP_DIR  # the cluster's processes, one pid a line
    python scripts/ray_local.py stop TEMP_DIR [--grace S]
    python scripts/ray_local.py ready URL... [--timeout S]  # until each URL answers 200, or exit 1

``ray start`` returns before the head node's dashboard agent is up; ``ray job submit`` in that window
fails with "No available agent to submit job" once the dashboard's 10 s wait for the agent runs out
(seen on a busy 2-core machine), so ray_local.sh waits for the dashboard and the agent's health check. Under
token auth (``RAY_AUTH_MODE=token``, which a process's own local ``ray.init()`` sets in its environment) the
requests carry the token as ``ray job submit``'s do.

``ray stop`` has no option to pick a cluster (Ray 2.60: only --force, --grace-period): it ends every
Ray process of the machine, other users' and other runs' clusters included. A cluster started with
``ray start --temp-dir=TEMP_DIR`` is found instead by that directory: every process ``ray start``
launches (GCS server, raylet, dashboard and its agents, log monitor, autoscaler monitor, client server)
names it, or its session directory inside it, on its command line; workers and a job's driver do not
(workers rename themselves ``ray::...``), so the descendants of those processes are taken with them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
import urllib.error
import urllib.request

import psutil


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the kernel had free on loopback a moment ago (all bound at once, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _names_dir(cmdline: list[str], dirs: set[str]) -> bool:
    """An argument is one of ``dirs`` or a path inside it (``/tmp/lh_ray.ab`` does not match ``.abc``)."""
    return any(arg == d or arg.endswith("=" + d) or f"{d}/" in arg for arg in cmdline for d in dirs)


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the cluster whose ``--temp-dir`` is ``temp_dir``, their descendants included;
    never this process or its ancestors (whose command lines may name the directory too)."""
    dirs = {temp_dir.rstrip("/"), os.path.realpath(temp_dir)}  # as given to ray start, and resolved
    own = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    roots = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid not in own and _names_dir(p.info["cmdline"] or [], dirs):
                roots.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            found.update({c.pid: c for c in p.children(recursive=True) if c.pid not in own})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(found.values())


def stop(temp_dir: str, grace: float = 3.0) -> int:
    """SIGTERM every process of the cluster, SIGKILL what is left after ``grace`` seconds; the count.
    (The GCS server and the autoscaler monitor outlive SIGTERM for more than 8 s when measured; the
    cluster is being thrown away, so a short grace costs nothing.)"""
    procs = cluster_processes(temp_dir)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


def auth_headers() -> dict[str, str]:
    """The header Ray's own clients send under token auth (RAY_AUTH_MODE=token), else none."""
    try:
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    except ImportError:  # a Ray without token auth
        return {}
    return dict(get_auth_headers_if_auth_enabled({}))


def _answers(url: str, headers: dict[str, str]) -> str | None:
    """None when ``url`` answers 200, else what it answered (or why it did not)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}" + (" (token auth: no token or a wrong one)" if e.code == 401 else "")
    except (OSError, ValueError) as e:  # refused, reset, timed out, bad URL
        return str(getattr(e, "reason", e))


def wait_ready(urls: list[str], timeout: float = 120.0, interval: float = 0.25) -> None:
    """Return once every URL has answered 200 (each in turn); TimeoutError naming the first that did not."""
    deadline, headers = time.monotonic() + timeout, auth_headers()
    for url in urls:
        while (why := _answers(url, headers)) is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout:g} s (last: {why})")
            time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/ray_local.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ports").add_argument("n", type=int)
    sub.add_parser("pids").add_argument("temp_dir")
    s = sub.add_parser("stop")
    s.add_argument("temp_dir")
    s.add_argument("--grace", type=float, default=3.0)
    r = sub.add_parser("ready")
    r.add_argument("urls", nargs="+")
    r.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    if args.cmd == "ports":
        print(" ".join(map(str, free_ports(args.n))))
    elif args.cmd == "ready":
        try:
            wait_ready(args.urls, args.timeout)
        except TimeoutError as e:
            print(f"the Ray cluster is not ready: {e}", file=sys.stderr)
            return 1
    elif args.cmd == "pids":
        print("\n".join(str(q.pid) for q in cluster_processes(args.temp_dir)))
    else:
        n = stop(args.temp_dir, args.grace)
        print(f"stopped {n} processes of the Ray cluster in {args.temp_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
