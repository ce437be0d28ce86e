"""Run untrusted Python in a separate, limited process.

Layers, each reported in ``Sandbox.protection`` (and so in the Python env's step info):

* Linux namespaces via util-linux ``unshare`` (``--net --pid --mount --ipc --uts``, plus ``--user``
  when not root): no network (only a down loopback), its own PID space (the host's processes are
  invisible and unkillable; when its init dies every process in it dies), private tmpfs over
  ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock`` (writes never reach the host; the working
  directory lives there). Used when ``unshare`` works here (probed once); bubblewrap is not needed.
* A throw-away unprivileged uid (when started as root and a world-executable Python exists):
  host files readable only by root (``/etc/shadow``, 0600 temp files) stay unreadable, and the
  process-count limit applies to this uid alone.
* rlimits: CPU seconds, address space (RLIMIT_AS), file size, process count, open files, no core.
* A wall-clock timeout; then every process of the sandbox uid, the process group and the PID
  namespace are killed. The boot process is a child subreaper: whatever the code leaves running
  (daemons, fork bombs) is killed and reaped before the call returns, namespaces or not.
* A minimal environment (no host variables), ``python -I`` (no user site, no PYTHON* vars), code
  passed on stdin and written into the private directory, output captured to capped files.

Without namespaces (no ``unshare`` or no permission) the sandbox still runs with rlimits, the uid
drop where possible and a private temp dir, and says so: ``protection["namespaces"] == []``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

NAMESPACE_FLAGS = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--ipc", "--uts"]
TMPFS_DIRS = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]
_SIGNAL_REASONS = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded",
    signal.SIGKILL: "killed (SIGKILL: memory, CPU or process limit)",
    signal.SIGSEGV: "segmentation fault",
}
_uid_counter = itertools.count(int.from_bytes(os.urandom(2), "little"))
_uid_lock = threading.Lock()


@dataclass
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 8
    nproc: int = 32
    nofile: int = 64
    tmpfs_mb: int = 64
    output_chars: int = 4000


@dataclass
class SandboxResult:
    exit_code: int | None  # None when killed by a signal
    stdout: str
    stderr: str
    timed_out: bool = False
    reason: str | None = None  # why it did not finish normally ("CPU time limit exceeded", ...)
    wall_s: float = 0.0
    protection: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# --- probing ------------------------------------------------------------------------------------------
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


def _next_uid() -> int:
    with _uid_lock:
        return 200_000 + next(_uid_counter) % 50_000


# --- the boot script: runs inside the namespaces, as root there, then becomes the sandbox -------------
_BOOT = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
code = sys.stdin.buffer.read()
libc = ctypes.CDLL(None, use_errno=True)
mounted = []
if cfg["mount"]:
    opts = ("size=%dm,mode=1777" % cfg["tmpfs_mb"]).encode()
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


class Sandbox:
    """Runs Python code under the limits; one ``run_python`` call = one fresh process tree."""

    def __init__(self, limits: SandboxLimits | None = None, use_namespaces: bool = True):
        self.limits = limits or SandboxLimits()
        self.mode = namespace_mode() if use_namespaces else "none"
        self.python, python_ok = sandbox_python()
        self.drop_uid = os.geteuid() == 0 and python_ok and self.mode != "user"
        self.protection = self._describe()

    def _describe(self) -> dict:
        ns = ["net", "pid", "mount", "ipc", "uts"] + (["user"] if self.mode == "user" else [])
        lim = self.limits
        return {
            "namespaces": ns if self.mode != "none" else [],
            "network": "isolated" if self.mode != "none" else "host (not isolated)",
            "private_tmp": "tmpfs" if self.mode != "none" else "temp dir only",
            "uid": "unprivileged throw-away uid" if self.drop_uid else "unchanged",
            "rlimits": f"cpu={lim.cpu_s}s as={lim.memory_mb}MB fsize={lim.file_mb}MB nproc={lim.nproc}",
            "wall_s": lim.wall_s,
        }

    def _rlimits(self) -> dict[str, tuple[int, int]]:
        mb = 1024 * 1024
        lim = self.limits
        out = {
            "RLIMIT_CPU": lim.cpu_s,
            "RLIMIT_AS": lim.memory_mb * mb,
            "RLIMIT_FSIZE": lim.file_mb * mb,
            "RLIMIT_NOFILE": lim.nofile,
            "RLIMIT_CORE": 0,
        }
        if self.drop_uid or self.mode == "none":  # NPROC counts per uid; never cap the host's own uid
            out["RLIMIT_NPROC"] = lim.nproc if self.drop_uid else 0
        out = {k: (v, v) for k, v in out.items() if not (k == "RLIMIT_NPROC" and v == 0)}
        out["RLIMIT_CPU"] = (
            lim.cpu_s,
            lim.cpu_s + 1,
        )  # soft limit -> SIGXCPU (a clear reason), hard -> SIGKILL
        return out

    def run_python(self, code: str) -> SandboxResult:
        start = time.monotonic()
        host_dir = tempfile.mkdtemp(prefix="lh-sbx-")
        os.chmod(host_dir, 0o711)  # the sandbox uid must reach work/ (no namespaces); nothing is listable
        uid = _next_uid() if self.drop_uid else None
        try:
            workdir = os.path.join(host_dir, "work")
            os.makedirs(workdir)
            cfg = {
                "mount": self.mode != "none",
                "tmpfs": TMPFS_DIRS,
                "tmpfs_mb": self.limits.tmpfs_mb,
                "workdir": workdir,
                "uid": uid,
                "rlimits": self._rlimits(),
                "python": self.python,
            }
            result = self._launch(cfg, code.encode("utf-8", "replace"), host_dir)
        finally:
            if uid is not None and self.mode == "none":
                _kill_uid(uid)  # no PID namespace: reap whatever that uid left running
            shutil.rmtree(host_dir, ignore_errors=True)
        result.wall_s = time.monotonic() - start
        result.protection = self.protection
        return result

    def _command(self, cfg: dict) -> list[str]:
        boot = [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg)]
        if self.mode == "none":
            return boot
        extra = ["--user", "--map-root-user"] if self.mode == "user" else []
        return [shutil.which("unshare") or "unshare", *extra, *NAMESPACE_FLAGS, "--", *boot]

    def _launch(self, cfg: dict, code: bytes, host_dir: str) -> SandboxResult:
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
                proc.communicate(code, timeout=self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                if cfg["uid"] is not None:  # kill the code first; the boot process then reaps and exits
                    _kill_uid(cfg["uid"])
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=2)
            finally:
                _kill_group(proc)
        return self._result(proc.returncode, timed_out, out_path, err_path)

    def _result(self, rc: int, timed_out: bool, out_path: str, err_path: str) -> SandboxResult:
        stdout, stderr = (
            _read_capped(out_path, self.limits.output_chars),
            _read_capped(err_path, self.limits.output_chars),
        )
        reason = None
        if timed_out:
            reason = f"wall-clock timeout after {self.limits.wall_s:g} s"
        elif rc is not None and rc < 0:
            reason = _SIGNAL_REASONS.get(-rc, f"killed by signal {-rc}")
        elif rc is not None and rc >= 128 and (rc - 128) in _SIGNAL_REASONS:
            reason = _SIGNAL_REASONS[rc - 128]  # a shell-style status from unshare
        code = rc if (rc is not None and rc >= 0 and not timed_out and reason is None) else None
        return SandboxResult(code, stdout, stderr, timed_out, reason)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


def _kill_uid(uid: int) -> None:
    """Kill every process of ``uid`` from a helper that becomes that uid (kill(-1) is then scoped)."""
    pid = os.fork()
    if pid == 0:  # child: never returns into the caller's code
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 1)
    text = data.decode("utf-8", "replace")
    if len(text) > limit:
        text = text[:limit] + f"\n[output cut at {limit} characters]"
    return text


def describe(result: SandboxResult) -> str:
    """The tool-result text of one run: stdout, then stderr under a label."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    return "\n".join(parts) if parts else "(no output)"
