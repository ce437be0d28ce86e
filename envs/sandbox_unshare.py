"""The weak sandbox backends: util-linux ``unshare`` namespaces, or no namespaces at all.

Used only when the configuration accepts a weak sandbox (``allow_weak=True`` or an explicit
backend): the host's root filesystem stays visible (read-only protection is only the uid's file
permissions), filesystem sockets and AF_VSOCK stay reachable, and the limits are per process.

* Namespaces via ``unshare`` (``--net --pid --mount --ipc --uts``, plus ``--user`` when not
  root): no network (a down loopback), its own PID space, private tmpfs over ``/tmp``,
  ``/var/tmp``, ``/dev/shm``, ``/run/lock`` (with ``size`` and ``nr_inodes``).
* A throw-away unprivileged uid (as root, when a world-executable Python exists), drawn at random
  per call (envs/sandbox_common.SANDBOX_UIDS): root-only host files stay unreadable and
  ``RLIMIT_NPROC`` holds for the call alone.
* rlimits: CPU seconds, address space, file size, process count, open files, no core.
* A wall-clock timeout, then every process of the call's uid, its process group and the PID
  namespace are killed. The boot process is a child subreaper, so whatever the code leaves running
  is killed and reaped before the call returns.
* A minimal environment, ``python -I``, code passed on stdin, output captured to capped files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from envs.sandbox_common import (
    SandboxLimits,
    SandboxResult,
    allocate_uid,
    kill_uid,
    read_capped,
    release_uid,
    status_reason,
)

NAMESPACE_FLAGS = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--ipc", "--uts"]
TMPFS_DIRS = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]


@functools.cache
def namespace_mode() -> str:
    """ "root" (unshare as root), "user" (unshare with a user namespace) or "none"."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return "none"
    modes = [("root", [])] if os.geteuid() == 0 else []
    modes.append(("user", ["--user", "--map-root-user"]))
    for mode, extra in modes:
        try:
            r = subprocess.run([unshare, *extra, *NAMESPACE_FLAGS, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return mode
    return "none"


def _world_executable(path: str) -> bool:
    path = os.path.realpath(path)
    if not os.path.isfile(path) or not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(path)
    while parent != "/":
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(parent)
    return True


@functools.cache
def sandbox_python() -> tuple[str, bool]:
    """(interpreter for sandboxed code, whether an unprivileged uid can run it)."""
    candidates = [sys.executable, shutil.which("python3"), "/usr/bin/python3", "/usr/local/bin/python3"]
    for c in candidates:
        if c and _world_executable(c):
            return os.path.realpath(c), True
    return os.path.realpath(sys.executable), False


# --- the boot script: runs inside the namespaces, as root there, then becomes the sandbox -------------
_BOOT = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
code = sys.stdin.buffer.read()
libc = ctypes.CDLL(None, use_errno=True)
mounted = []
if cfg["mount"]:
    opts = ("size=%dm,nr_inodes=%d,mode=1777" % (cfg["tmpfs_mb"], cfg["tmpfs_inodes"])).encode()
    for d in cfg["tmpfs"]:
        if os.path.isdir(d) and libc.mount(b"tmpfs", d.encode(), b"tmpfs", 0, opts) == 0:
            mounted.append(d)
work = "/tmp/sandbox" if "/tmp" in mounted else cfg["workdir"]
os.makedirs(work, exist_ok=True)
with open(os.path.join(work, "main.py"), "wb") as f:
    f.write(code)
uid = cfg["uid"]
if uid is not None:
    os.chown(work, uid, uid)
    os.chown(os.path.join(work, "main.py"), uid, uid)
os.chmod(work, 0o700)
env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
       "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
# This process is the PID namespace's init, which the kernel shields from signals it has no
# handler for (SIGXCPU, even SIGKILL from inside): the code runs in a child, init only waits.
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the code come back to us, not to host init
pid = os.fork()
if pid == 0:
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG = SIGKILL (the uid change reset it)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    os.chdir(work)
    os.execve(cfg["python"], [cfg["python"], "-I", "main.py"], env)
while True:
    try:
        done, status = os.waitpid(-1, 0)
    except ChildProcessError:
        os._exit(1)
    if done == pid:
        break
# Reap what the code left behind (a subreaper inherits orphans): kill that uid's processes from a
# helper that becomes the uid (so kill(-1) reaches nothing else), then wait for every child.
if uid is not None and os.fork() == 0:
    try:
        os.setgid(uid)
        os.setuid(uid)
        os.kill(-1, 9)
    finally:
        os._exit(0)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


class UnshareBackend:
    """The previous sandbox: namespaces from ``unshare`` (``use_namespaces``) or none."""

    def __init__(self, limits: SandboxLimits, use_namespaces: bool = True):
        self.limits = limits
        self.mode = namespace_mode() if use_namespaces else "none"
        self.name = "unshare" if self.mode != "none" else "none"
        self.python, python_ok = sandbox_python()
        self.drop_uid = os.geteuid() == 0 and python_ok and self.mode != "user"

    def describe(self) -> dict:
        ns = ["net", "pid", "mount", "ipc", "uts"] + (["user"] if self.mode == "user" else [])
        lim = self.limits
        return {
            "backend": self.name,
            "namespaces": ns if self.mode != "none" else [],
            "network": "isolated" if self.mode != "none" else "host (not isolated)",
            "filesystem": "host root visible (weak: only file permissions protect it)",
            "private_tmp": "tmpfs" if self.mode != "none" else "temp dir only",
            "uid": "unprivileged throw-away uid" if self.drop_uid else "unchanged",
            "seccomp": "none",
            "cgroup": "none",
            "limits": "per process",
            "rlimits": f"cpu={lim.cpu_s}s as={lim.memory_mb}MB fsize={lim.file_mb}MB nproc={lim.nproc}",
            "wall_s": lim.wall_s,
        }

    def _rlimits(self) -> dict[str, tuple[int, int]]:
        mb = 1024 * 1024
        lim = self.limits
        out = {
            "RLIMIT_CPU": (lim.cpu_s, lim.cpu_s + 1),  # soft: SIGXCPU (a clear reason); hard: SIGKILL
            "RLIMIT_AS": (lim.memory_mb * mb,) * 2,
            "RLIMIT_FSIZE": (lim.file_mb * mb,) * 2,
            "RLIMIT_NOFILE": (lim.nofile,) * 2,
            "RLIMIT_CORE": (0, 0),
        }
        if self.drop_uid:  # NPROC counts per uid; never cap the host's own uid
            out["RLIMIT_NPROC"] = (lim.nproc, lim.nproc)
        return out

    def run(self, code: str, wall_s: float | None = None) -> SandboxResult:
        wall_s = self.limits.wall_s if wall_s is None else wall_s
        start = time.monotonic()
        host_dir = tempfile.mkdtemp(prefix="lh-sbx-")
        os.chmod(host_dir, 0o711)  # the sandbox uid must reach work/ (no namespaces); nothing is listable
        uid = allocate_uid() if self.drop_uid else None
        try:
            workdir = os.path.join(host_dir, "work")
            os.makedirs(workdir)
            cfg = {
                "mount": self.mode != "none",
                "tmpfs": TMPFS_DIRS,
                "tmpfs_mb": self.limits.tmpfs_mb,
                "tmpfs_inodes": self.limits.tmpfs_inodes,
                "workdir": workdir,
                "uid": uid,
                "rlimits": self._rlimits(),
                "python": self.python,
            }
            result = self._launch(cfg, code.encode("utf-8", "replace"), host_dir, wall_s)
        finally:
            if uid is not None:
                kill_uid(uid)  # without a PID namespace: reap whatever that uid left running
                release_uid(uid)
            shutil.rmtree(host_dir, ignore_errors=True)
        result.wall_s = time.monotonic() - start
        result.host_uid = uid
        return result

    def _command(self, cfg: dict) -> list[str]:
        boot = [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg)]
        if self.mode == "none":
            return boot
        extra = ["--user", "--map-root-user"] if self.mode == "user" else []
        return [shutil.which("unshare") or "unshare", *extra, *NAMESPACE_FLAGS, "--", *boot]

    def _launch(self, cfg: dict, code: bytes, host_dir: str, wall_s: float) -> SandboxResult:
        out_path, err_path = os.path.join(host_dir, "stdout"), os.path.join(host_dir, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                self._command(cfg),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            )
            timed_out = False
            try:
                proc.communicate(code, timeout=wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                if cfg["uid"] is not None:  # kill the code first; the boot process then reaps and exits
                    kill_uid(cfg["uid"])
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=2)
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
        limit = self.limits.output_chars
        stdout, stderr = read_capped(out_path, limit), read_capped(err_path, limit)
        rc = proc.returncode
        reason = f"wall-clock timeout after {wall_s:g} s" if timed_out else status_reason(rc)
        code = rc if (rc is not None and rc >= 0 and not timed_out and reason is None) else None
        return SandboxResult(code, stdout, stderr, timed_out, reason)
