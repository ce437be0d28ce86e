"""Types and helpers shared by the sandbox backends (envs/sandbox.py is the public entry point)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_UIDS = range(1_000_000_000, 2_000_000_000)
"""Host uids the sandbox runs code as (as root): one drawn at random per call, never in use twice
at once and far above the uids of real accounts, so no call can guess another's uid or share one
with a host process."""

SIGNAL_REASONS = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded",
    signal.SIGKILL: "killed (SIGKILL: memory, CPU or process limit)",
    signal.SIGSEGV: "segmentation fault",
}


_POSITIVE_LIMITS = ("cpu_s", "wall_s", "memory_mb", "file_mb", "nproc", "nofile", "tmpfs_mb", "tmpfs_inodes")


@dataclass
class SandboxLimits:
    """Limits of one call. With the bwrap backend and cgroups, ``memory_mb``, ``nproc`` and
    ``cpu_s`` hold for all processes of the call together (memory includes shared memory and
    the tmpfs); otherwise per process (memory as address space), with ``nproc`` per call uid."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 8
    nproc: int = 32
    nofile: int = 64
    tmpfs_mb: int = 64  # /tmp and /dev/shm together
    tmpfs_inodes: int = 4096  # files on that tmpfs (also bounds tmpfs xattr memory: 1 KiB each)
    output_chars: int = 4000

    def __post_init__(self) -> None:
        for name in _POSITIVE_LIMITS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    exit_code: int | None  # None when killed by a signal or stopped by a limit
    stdout: str
    stderr: str
    timed_out: bool = False
    reason: str | None = None  # why it did not finish normally ("CPU time limit exceeded", ...)
    wall_s: float = 0.0
    protection: dict = field(default_factory=dict)
    host_uid: int | None = None  # the host uid the code ran as (None: unchanged)
    cpu_s: float | None = None  # CPU time of all its processes, when measured (cgroups)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    """No sandbox backend that the configuration accepts can run here (the message says why)."""


# --- uids ---------------------------------------------------------------------------------------------
_uids_in_use: set[int] = set()
_uid_lock = threading.Lock()


def allocate_uid() -> int:
    with _uid_lock:
        while True:
            uid = SANDBOX_UIDS.start + secrets.randbelow(len(SANDBOX_UIDS))
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def processes_of_uid(uid: int) -> list[int]:
    """Pids whose real uid is ``uid`` (read from /proc; no fork, safe from threads)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int((d / "status").read_text().split("\nUid:")[1].split()[0]) == uid:
                out.append(int(d.name))
    return out


def kill_uid(uid: int, rounds: int = 50) -> None:
    """SIGKILL every process of ``uid`` (a uid only this call uses) until none is left."""
    for _ in range(rounds):
        pids = processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# --- output -------------------------------------------------------------------------------------------
def read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 1)
    text = data.decode("utf-8", "replace")
    if len(text) > limit:
        text = text[:limit] + f"\n[output cut at {limit} characters]"
    return text


def status_reason(rc: int | None) -> str | None:
    """Why a process status is abnormal: a negative (Popen) or shell-style 128+N signal status."""
    if rc is not None and rc < 0:
        return SIGNAL_REASONS.get(-rc, f"killed by signal {-rc}")
    if rc is not None and rc >= 128 and (rc - 128) in SIGNAL_REASONS:
        return SIGNAL_REASONS[rc - 128]
    return None
