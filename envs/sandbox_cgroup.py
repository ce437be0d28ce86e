"""One cgroup per sandbox call: memory (with shared memory, tmpfs and kernel memory), pids, CPU time.

The limits of ``SandboxLimits`` then hold for the whole process tree of a call, not per process:
forked children, SysV/POSIX shared memory and files on the call's tmpfs are all charged to the
call's memory cgroup, and the host reads the group's CPU time (cpuacct in v1, the always present
``cpu.stat`` in v2) to stop the call when all of its processes together have used ``cpu_s``.

Deviation: no CPU bandwidth limit (cpu controller). With it, every sandbox group, and all of them
together under their parent, is one scheduling entity with the weight of a single task: on a busy
host 32 concurrent calls then share what one host process gets (measured: a call's 1 CPU-s took
10 s of wall time at load 22 on 2 cores). The CPU a call can take is bounded by ``cpu_s`` instead.

Both hierarchies are supported, found from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``:

* cgroup v2 with the memory and pids controllers available below our cgroup. Controllers
  can only be handed to children of a cgroup without processes (the "no internal processes"
  rule), so this works when we run in the root cgroup, or under a delegated cgroup named by
  ``LONGHORIZON_SANDBOX_CGROUP`` (an empty cgroup v2 directory we may write, e.g. one made by
  ``systemd-run --scope -p Delegate=yes``).
* cgroup v1 (or hybrid) with memory, pids and cpuacct hierarchies.

Per-call groups live in ``<our cgroup>/longhorizon-sandbox/call-<host pid>-<random>`` and are
removed after the call; groups left by dead host processes are removed at the next probe. Creating
them needs root (or a delegated tree); without it ``probe()`` says why and the sandbox falls back to
rlimits and its unique uid.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field

PARENT_NAME = "longhorizon-sandbox"
DELEGATED_ENV = "LONGHORIZON_SANDBOX_CGROUP"
V1_REQUIRED = ("memory", "pids", "cpuacct")
V2_REQUIRED = ("memory", "pids")
MB = 1024 * 1024


@dataclass(frozen=True)
class CgroupLayout:
    """Where per-call groups are created: v2 one directory, v1 one per controller hierarchy."""

    version: int
    parents: dict[str, str]  # v2: {"unified": dir}; v1: controller -> dir

    def describe(self) -> str:
        return f"cgroup v{self.version} per call (memory incl. shm/tmpfs, pids, CPU time)"


@dataclass(frozen=True)
class CgroupProbe:
    layout: CgroupLayout | None
    reason: str  # why not, when layout is None


@dataclass
class CallCgroup:
    """The cgroup(s) of one call. ``procs_files`` are what the launcher writes its pid into."""

    layout: CgroupLayout
    dirs: dict[str, str] = field(default_factory=dict)

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def _dir(self, controller: str) -> str:
        return self.dirs["unified"] if self.layout.version == 2 else self.dirs[controller]

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used by all processes of the group so far."""
        with contextlib.suppress(OSError, ValueError):
            if self.layout.version == 2:
                stat = _read_keyed(os.path.join(self.dirs["unified"], "cpu.stat"))
                return stat.get("usage_usec", 0) / 1e6
            return int(_read(os.path.join(self._dir("cpuacct"), "cpuacct.usage"))) / 1e9
        return 0.0

    def oom_kills(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            if self.layout.version == 2:
                return _read_keyed(os.path.join(self._dir("memory"), "memory.events")).get("oom_kill", 0)
            return _read_keyed(os.path.join(self._dir("memory"), "memory.oom_control")).get("oom_kill", 0)
        return 0

    def memory_peak_mb(self) -> float | None:
        name = "memory.peak" if self.layout.version == 2 else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int(_read(os.path.join(self._dir("memory"), name))) / MB
        return None

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError, ValueError):
                out.update(int(p) for p in _read(path).split())
        return sorted(out)

    def kill(self, rounds: int = 200) -> None:
        """SIGKILL every process of the group until it is empty (forks racing the kill are caught
        by the next round; the pids limit bounds how many there can be)."""
        if self.layout.version == 2:
            with contextlib.suppress(OSError):
                _write(os.path.join(self.dirs["unified"], "cgroup.kill"), "1")
        for _ in range(rounds):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def remove(self) -> None:
        """Remove the group (empty by now: its processes were killed and reaped); retried briefly,
        since a killed process leaves the group only once it has been reaped."""
        for d in dict.fromkeys(self.dirs.values()):
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.kill(rounds=1)
                    time.sleep(0.01)


def create(layout: CgroupLayout, memory_mb: int, pids_max: int) -> CallCgroup:
    """A fresh group with the limits written; raises OSError when the kernel refuses."""
    name = f"call-{os.getpid()}-{secrets.token_hex(6)}"
    group = CallCgroup(layout)
    try:
        if layout.version == 2:
            d = os.path.join(layout.parents["unified"], name)
            os.mkdir(d)
            group.dirs["unified"] = d
            _limits_v2(d, memory_mb, pids_max)
        else:
            for controller, parent in layout.parents.items():
                d = os.path.join(parent, name)
                if d not in group.dirs.values():
                    os.mkdir(d)
                group.dirs[controller] = d
            _limits_v1(group.dirs, memory_mb, pids_max)
    except OSError:
        group.remove()
        raise
    return group


def _limits_v2(d: str, memory_mb: int, pids_max: int) -> None:
    _write(os.path.join(d, "memory.max"), str(memory_mb * MB))
    _write_if_exists(os.path.join(d, "memory.swap.max"), "0")
    _write_if_exists(os.path.join(d, "memory.oom.group"), "1")  # an OOM kills the whole call
    _write(os.path.join(d, "pids.max"), str(pids_max))


def _limits_v1(dirs: dict[str, str], memory_mb: int, pids_max: int) -> None:
    mem = dirs["memory"]
    _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_mb * MB))
    _write_if_exists(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_mb * MB))  # no swap
    # v1 charges TCP buffers only to groups with a TCP limit (v2 charges them to memory.current)
    _write_if_exists(os.path.join(mem, "memory.kmem.tcp.limit_in_bytes"), str(memory_mb * MB))
    _write(os.path.join(dirs["pids"], "pids.max"), str(pids_max))


# --- probing ------------------------------------------------------------------------------------------
_probe_lock = threading.Lock()


def probe() -> CgroupProbe:
    """The per-call layout this machine allows (probed once per process, with a trial group)."""
    with _probe_lock:
        return _probe()


@functools.cache
def _probe() -> CgroupProbe:
    if not os.path.isdir("/sys/fs/cgroup"):
        return CgroupProbe(None, "no /sys/fs/cgroup")
    mounts, own = _mounts(), _own_cgroups()
    reasons = []
    for finder in (_layout_v2, _layout_v1):
        try:
            layout = finder(mounts, own)
        except OSError as e:
            reasons.append(f"{finder.__name__[-2:]}: {e.strerror or e} ({e.filename or ''})")
            continue
        if isinstance(layout, str):
            reasons.append(layout)
            continue
        try:
            _clean_stale(layout)
            create(layout, 64, 8).remove()
        except OSError as e:
            reasons.append(
                f"v{layout.version}: cannot create a limited group: {e.strerror or e} ({e.filename})"
            )
            continue
        return CgroupProbe(layout, "")
    return CgroupProbe(None, "; ".join(reasons))


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    try:
        return parse_mountinfo(_read("/proc/self/mountinfo"))
    except OSError:
        return []


def _own_cgroups() -> dict[str, str]:
    try:
        return parse_proc_cgroup(_read("/proc/self/cgroup"))
    except OSError:
        return {}


def parse_mountinfo(text: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount in a mountinfo text."""
    out = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) > 4 and r and r[0] in ("cgroup", "cgroup2"):
            out.append((r[0], f[3], f[4], set(r[2].split(",")) if len(r) > 2 else set()))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Controller (or "unified" for the v2 line) -> cgroup path, from a /proc/<pid>/cgroup text."""
    out = {}
    for line in text.splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else ["unified"]:
            out[name] = path
    return out


def _on_disk(mount_root: str, mount_point: str, path: str) -> str:
    rel = path[len(mount_root) :] if mount_root != "/" and path.startswith(mount_root) else path
    return os.path.join(mount_point, rel.lstrip("/"))


def _layout_v2(mounts, own) -> CgroupLayout | str:
    v2 = [m for m in mounts if m[0] == "cgroup2"]
    if not v2:
        return "v2: not mounted"
    _, root, point, _ = v2[0]
    delegated = os.environ.get(DELEGATED_ENV)
    if delegated:
        parent = delegated
    else:
        ours = _on_disk(root, point, own.get("unified", "/"))
        if own.get("unified", "/") != "/" or root != "/":
            return (
                f"v2: our cgroup {ours} holds processes, so it cannot give controllers to children; "
                f"set {DELEGATED_ENV} to an empty delegated cgroup"
            )
        available = set(_read(os.path.join(ours, "cgroup.controllers")).split())
        missing = [c for c in V2_REQUIRED if c not in available]
        if missing:
            return f"v2: controllers {missing} are not available in {ours} (bound to v1, or not delegated)"
        parent = os.path.join(ours, PARENT_NAME)
        _write(os.path.join(ours, "cgroup.subtree_control"), " ".join(f"+{c}" for c in V2_REQUIRED))
    os.makedirs(parent, exist_ok=True)
    _write(os.path.join(parent, "cgroup.subtree_control"), " ".join(f"+{c}" for c in V2_REQUIRED))
    return CgroupLayout(2, {"unified": parent})


def _layout_v1(mounts, own) -> CgroupLayout | str:
    parents = {}
    for controller in V1_REQUIRED:
        hits = [m for m in mounts if m[0] == "cgroup" and controller in m[3]]
        if not hits:
            return f"v1: no {controller} hierarchy mounted"
        _, root, point, _ = hits[0]
        parent = os.path.join(_on_disk(root, point, own.get(controller, "/")), PARENT_NAME)
        os.makedirs(parent, exist_ok=True)
        parents[controller] = parent
    return CgroupLayout(1, parents)


def _clean_stale(layout: CgroupLayout) -> None:
    """Remove empty call groups of host processes that no longer exist."""
    for parent in dict.fromkeys(layout.parents.values()):
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                parts = name.split("-")
                stale = len(parts) == 3 and parts[0] == "call" and parts[1].isdigit()
                if stale and not os.path.exists(f"/proc/{parts[1]}"):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(parent, name))


# --- files --------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _read_keyed(path: str) -> dict[str, int]:
    out = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _write_if_exists(path: str, value: str) -> None:
    if os.path.exists(path):
        _write(path, value)
