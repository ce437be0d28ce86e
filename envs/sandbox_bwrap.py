"""The strong sandbox backend: bubblewrap (``bwrap``) with seccomp, per-call cgroups and tmpfs.

One call runs as follows (as root; the parts that need root are skipped otherwise and reported):

1. The host creates the call's cgroup (envs/sandbox_cgroup.py), draws a random unprivileged uid
   (envs/sandbox_common.SANDBOX_UIDS), writes the code to a private file and the seccomp program
   (envs/seccomp.py) to a memfd.
2. A small boot process (``python -I -S``, as root) joins the cgroup, enters a private mount
   namespace, mounts the call's tmpfs there with ``size`` and ``nr_inodes`` (bwrap cannot set
   ``nr_inodes``), sets the rlimits, becomes the random uid and executes bwrap.
3. bwrap, unprivileged, creates a fresh user namespace (uid 1000 inside, mapped to the random uid
   only; no further user namespaces inside) and new mount, PID, network (loopback only), IPC, UTS
   and cgroup namespaces, builds a root that holds only the Python runtime (interpreter, standard
   library, the shared libraries they load), a handful of tools (sh, sleep, cat, echo, ls, env,
   true, false), a synthetic ``/etc`` (passwd, group, hosts; a root-only shadow), ``/proc`` of the
   new PID namespace, a ``/dev`` with null, zero and urandom only, and the tmpfs as ``/tmp`` and
   ``/dev/shm``; remounts the root read-only, loads the seccomp filter and runs, in a new session
   and with an empty environment, ``sh -c "python3 -I main.py"`` in ``/tmp/sandbox`` as the PID
   namespace's init (``--as-pid-1``): when the code's main process ends, sh ends, and the kernel
   kills whatever the code left in the namespace.
4. The host waits on a pidfd, polling the cgroup's CPU time: past ``cpu_s`` (all processes
   together) or ``wall_s`` it kills the namespace's init (then, if needed, the group). The group
   is removed. Deviation: ``wall_s`` counts from the moment bwrap reports the code started, so the
   set-up (bounded separately by ``SETUP_TIMEOUT_S``) on a loaded machine is not the code's time;
   the env's tool time budgets count real time.

No host path is visible (no project checkout, home, /run, /sys, /var, host /etc, GPU devices), no
host socket is reachable (no filesystem socket is bound; abstract sockets and the loopback belong
to the new network namespace; AF_VSOCK and other families are refused by seccomp), and nothing
outlives the call. ``probe()`` checks once per process that all of this works here (with a trial
run) and says why not otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from envs import sandbox_cgroup, seccomp
from envs.sandbox_common import (
    SandboxLimits,
    SandboxResult,
    allocate_uid,
    kill_uid,
    read_capped,
    release_uid,
    status_reason,
)

log = logging.getLogger(__name__)

INSIDE_UID = 1000
WORKDIR = "/tmp/sandbox"
TOOLS = ("sh", "sleep", "cat", "echo", "ls", "env", "true", "false")
BOOT_FAILED = 125  # exit status of the boot process when it could not set the call up
POLL_S = 0.02
SETUP_TIMEOUT_S = 30.0  # bwrap's set-up, before the code's wall clock starts
PIDS_OVERHEAD = 2  # bwrap's own processes in the call's cgroup (its monitor and the namespace init)
_ETC = {
    "passwd": (0o644, f"root:x:0:0:root:/:/bin/sh\nsandbox:x:{INSIDE_UID}:{INSIDE_UID}::{WORKDIR}:/bin/sh\n"
               "nobody:x:65534:65534:nobody:/:/bin/sh\n"),
    "group": (0o644, f"root:x:0:\nsandbox:x:{INSIDE_UID}:\nnogroup:x:65534:\n"),
    "hosts": (0o644, "127.0.0.1 localhost sandbox\n::1 localhost\n"),
    "hostname": (0o644, "sandbox\n"),
    "shadow": (0o000, ""),  # as on any system: only root reads it (nobody is root in here)
}  # fmt: skip


# --- the boot process: root, between the host and bwrap -----------------------------------------------
_BOOT = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
def fail(what):
    os.write(2, ("sandbox boot: %s\n" % what).encode())
    os._exit(125)
for path in cfg["cgroup_procs"]:
    try:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        fail("cannot join cgroup %s: %s" % (path, e))
if cfg["scratch"]:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        fail("unshare(CLONE_NEWNS): %s" % os.strerror(ctypes.get_errno()))
    if libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
        fail("making / private: %s" % os.strerror(ctypes.get_errno()))
    opts = ("size=%dm,nr_inodes=%d,mode=0755" % (cfg["tmpfs_mb"], cfg["tmpfs_inodes"])).encode()
    if libc.mount(b"tmpfs", cfg["scratch"].encode(), b"tmpfs", 2 | 4, opts) != 0:  # MS_NOSUID | MS_NODEV
        fail("mounting the tmpfs: %s" % os.strerror(ctypes.get_errno()))
    for sub in ("tmp", "shm"):
        path = os.path.join(cfg["scratch"], sub)
        os.mkdir(path, 0o700)
        os.chown(path, cfg["uid"], cfg["uid"])
for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), tuple(value))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL (the uid change reset it)
os.execve(cfg["argv"][0], cfg["argv"], {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
"""


# --- the read-only root -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RootFs:
    """The bwrap arguments that build the sandbox's root, and what it holds (for reports)."""

    args: tuple[str, ...]
    python: str  # the interpreter's path inside
    binds: tuple[str, ...]


_PROBE_PYTHON = (
    "import json, os, sys, sysconfig; p = sysconfig.get_paths(); "
    "print(json.dumps({'exe': os.path.realpath(sys.executable), 'stdlib': p['stdlib'], "
    "'platstdlib': p['platstdlib'], 'hide': [p['purelib'], p['platlib']], "
    "'version': '%d.%d' % sys.version_info[:2]}))"
)


def _python_candidates() -> list[str]:
    names = ["/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3"), sys.executable]
    return [os.path.realpath(n) for n in dict.fromkeys(n for n in names if n and os.path.isfile(n))]


def _readable_by_anyone(path: str, execute: bool = False) -> bool:
    """Other users may read ``path`` (and run it / list it) and search every directory above it."""
    path = os.path.realpath(path)
    need = 0o005 if execute or os.path.isdir(path) else 0o004
    if os.stat(path).st_mode & need != need:
        return False
    parent = os.path.dirname(path)
    while True:
        if not os.stat(parent).st_mode & 0o001:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def _probe_python(exe: str) -> dict:
    out = subprocess.run([exe, "-I", "-c", _PROBE_PYTHON], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{exe} does not run: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def _shared_libraries(files: list[str]) -> set[str]:
    """Paths (as the loader names them) of the shared libraries and loaders of ``files``."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise RuntimeError("ldd not found (libc-bin); cannot list the Python runtime's libraries")
    out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60).stdout
    paths = set()
    for line in out.splitlines():
        line = line.strip()
        if "(0x" not in line:  # "file:" headers, "not a dynamic executable", ...
            continue
        target = line.split("=>", 1)[1] if "=>" in line else line
        target = target.split("(", 1)[0].strip()
        if target.startswith("/"):
            paths.add(target)
    return paths


def _walk(path: str) -> tuple[list[tuple[str, str]], str]:
    """Resolve ``path`` component by component: the symlinks met on the way ((target, link)
    pairs, links at real locations) and the real path at the end."""
    links: list[tuple[str, str]] = []
    cur, todo = "/", [p for p in path.split("/") if p]
    for _ in range(200):
        if not todo:
            return links, cur
        part = todo.pop(0)
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        if part == ".":
            continue
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt):
            target = os.readlink(nxt)
            links.append((target, nxt))
            todo = [p for p in target.split("/") if p] + todo
            if target.startswith("/"):
                cur = "/"
        else:
            cur = nxt
    raise RuntimeError(f"too many symlinks resolving {path}")


def _outermost(paths: set[str]) -> list[str]:
    """Drop paths that lie inside another path of the set (binding the outer one covers them)."""
    ordered = sorted(paths)
    return [p for p in ordered if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in ordered)]


def build_rootfs(need_world_readable: bool) -> RootFs:
    """The minimal root for the first Python interpreter here that the sandbox uid may run."""
    problems = []
    for exe in _python_candidates():
        if need_world_readable and not _readable_by_anyone(exe, execute=True):
            problems.append(f"{exe}: not readable by an unprivileged uid")
            continue
        try:
            info = _probe_python(exe)
        except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            problems.append(str(e))
            continue
        stdlib = [os.path.realpath(info["stdlib"]), os.path.realpath(info["platstdlib"])]
        if need_world_readable and not all(_readable_by_anyone(d) for d in stdlib):
            problems.append(f"{exe}: standard library {stdlib[0]} not readable by an unprivileged uid")
            continue
        return _assemble(info, stdlib)
    raise RuntimeError(
        "no Python runtime usable inside the sandbox: " + "; ".join(problems or ["none found"])
    )


def _assemble(info: dict, stdlib: list[str]) -> RootFs:
    exe = info["exe"]
    tools = {t: os.path.realpath(p) for t in TOOLS if (p := shutil.which(t, path="/usr/bin:/bin"))}
    if "sh" not in tools:
        raise RuntimeError("no /bin/sh here (the sandbox's init)")
    dynload = glob.glob(os.path.join(stdlib[-1], "lib-dynload", "*.so"))
    libs = _shared_libraries([exe, *tools.values(), *dynload])
    links: dict[str, str] = {}
    real_files = set()
    for lib in libs:
        chain, real = _walk(lib)
        links.update({link: target for target, link in chain})
        real_files.add(real)
    lib_dirs = {os.path.dirname(f) for f in real_files if os.path.basename(os.path.dirname(f)) != ""}
    dirs = _outermost({*stdlib, *lib_dirs})
    args: list[str] = []
    for d in dirs:
        args += ["--ro-bind", d, d]
    for hidden in info["hide"]:  # a site-packages inside the stdlib dir (e.g. /usr/local): hidden
        hidden = os.path.realpath(hidden)
        if os.path.isdir(hidden) and any(hidden.startswith(d + "/") for d in dirs):
            args += ["--tmpfs", hidden]
    args += ["--ro-bind", exe, exe]
    for name in ("python3", "python", f"python{info['version']}"):
        if f"/usr/bin/{name}" != exe:
            args += ["--symlink", exe, f"/usr/bin/{name}"]
    for name, real in tools.items():
        args += ["--ro-bind", real, f"/usr/bin/{name}"]
    covered = [*dirs, "/usr/bin"]
    for link, target in sorted(links.items()):
        if not any(link.startswith(d + "/") for d in covered):
            args += ["--symlink", target, link]
    if "/bin" not in links:
        args += ["--symlink", "usr/bin", "/bin"]
    binds = (*dirs, exe, *tools.values())
    return RootFs(tuple(args), "/usr/bin/python3", binds)


@functools.cache
def _etc_dir() -> str:
    """A synthetic /etc for the sandbox (root-owned, removed at exit)."""
    d = tempfile.mkdtemp(prefix="lh-sandbox-etc-")
    os.chmod(d, 0o755)
    for name, (mode, text) in _ETC.items():
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
    atexit.register(shutil.rmtree, d, True)
    return d


# --- probing ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BwrapProbe:
    ok: bool
    reason: str  # why not (ok False), or "" (ok True)
    bwrap: str | None = None
    root: RootFs | None = None
    cgroups: sandbox_cgroup.CgroupProbe | None = None


_probe_lock = threading.Lock()


def probe() -> BwrapProbe:
    """Whether this backend works here (once per process): bwrap, a Python runtime the sandbox may
    run, seccomp for this architecture, and a trial call that must print its result."""
    with _probe_lock:
        return _probe()


@functools.cache
def _probe() -> BwrapProbe:
    if not sys.platform.startswith("linux"):
        return BwrapProbe(False, "not Linux")
    bwrap = shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap",) if os.path.exists(p)), None)
    if bwrap is None:
        how = "apt-get install bubblewrap (scripts/setup.sh does this as root)"
        return BwrapProbe(False, f"bubblewrap (bwrap) is not installed: {how}")
    try:
        seccomp.host_arch()
        root = build_rootfs(need_world_readable=os.geteuid() == 0)
    except (RuntimeError, OSError) as e:
        return BwrapProbe(False, str(e), bwrap)
    cgroups = sandbox_cgroup.probe() if os.geteuid() == 0 else sandbox_cgroup.CgroupProbe(None, "not root")
    found = BwrapProbe(True, "", bwrap, root, cgroups)
    trial = BwrapBackend(SandboxLimits(cpu_s=5, wall_s=20), found).run("print(6 * 7)")
    if trial.stdout.strip() != "42":
        detail = (trial.reason or "") + " " + (trial.stderr.strip() or trial.stdout.strip())
        return BwrapProbe(False, f"a trial sandbox run failed: {detail.strip()[-500:]}", bwrap)
    return found


# --- one call -----------------------------------------------------------------------------------------
class BwrapBackend:
    """Runs code through bwrap as described in the module docstring."""

    name = "bwrap"

    def __init__(self, limits: SandboxLimits, found: BwrapProbe | None = None):
        self.limits = limits
        self.found = found or probe()
        if not self.found.ok:
            raise RuntimeError(self.found.reason)
        self.as_root = os.geteuid() == 0
        self.layout = self.found.cgroups.layout if self.found.cgroups else None
        self._seccomp = seccomp.program()

    def describe(self) -> dict:
        lim = self.limits
        cg = self.layout.describe() if self.layout else f"none ({self.found.cgroups.reason})"
        scope = "whole sandbox" if self.layout else "per process (no cgroup)"
        tmpfs = f"{lim.tmpfs_mb} MB, {lim.tmpfs_inodes} inodes" if self.as_root else f"{lim.tmpfs_mb} MB each"
        return {
            "backend": "bwrap",
            "namespaces": ["user", "mount", "pid", "net", "ipc", "uts", "cgroup"],
            "network": "isolated",
            "filesystem": "minimal read-only root (Python runtime, its libraries, a few tools); no host files",
            "private_tmp": f"tmpfs /tmp + /dev/shm ({tmpfs})",
            "devices": "/dev/null, /dev/zero, /dev/urandom",
            "uid": "unprivileged throw-away uid" if self.as_root else "own uid (not root)",
            "user_namespace": f"fresh per call (uid {INSIDE_UID} inside, no nested user namespaces)",
            "seccomp": "denies " + seccomp.describe(),
            "cgroup": cg,
            "limits": f"{scope}: memory={lim.memory_mb}MB pids={lim.nproc} cpu={lim.cpu_s}s",
            "rlimits": self._rlimit_text(),
            "wall_s": lim.wall_s,
        }

    def _rlimit_text(self) -> str:
        lim = self.limits
        return f"cpu={lim.cpu_s}s as={lim.memory_mb}MB fsize={lim.file_mb}MB nproc={lim.nproc} nofile={lim.nofile}"

    def _rlimits(self) -> dict[str, list[int]]:
        mb, lim = 1024 * 1024, self.limits
        out = {
            "RLIMIT_CPU": [lim.cpu_s, lim.cpu_s + 1],  # soft: SIGXCPU (a clear reason); hard: SIGKILL
            "RLIMIT_AS": [lim.memory_mb * mb] * 2,
            "RLIMIT_FSIZE": [lim.file_mb * mb] * 2,
            "RLIMIT_NOFILE": [lim.nofile] * 2,
            "RLIMIT_CORE": [0, 0],
        }
        if self.as_root:  # counted per uid, and this uid is the call's alone
            out["RLIMIT_NPROC"] = [lim.nproc + PIDS_OVERHEAD] * 2
        return out

    def _bwrap_argv(self, scratch: str | None, fds: dict[str, int]) -> list[str]:
        lim = self.limits
        argv = [self.found.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
        argv += ["--new-session", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--hostname", "sandbox"]
        argv += [*self.found.root.args, "--ro-bind", _etc_dir(), "/etc", "--proc", "/proc", "--dir", "/dev"]
        for dev in ("null", "zero", "urandom"):
            argv += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
        argv += ["--symlink", "/proc/self/fd", "/dev/fd"]
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            argv += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
        if scratch:
            argv += ["--bind", f"{scratch}/tmp", "/tmp", "--bind", f"{scratch}/shm", "/dev/shm"]
        else:  # not root: bwrap's own tmpfs (a size, but no inode limit)
            size = str(lim.tmpfs_mb * 1024 * 1024)
            argv += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm"]
        argv += ["--dir", WORKDIR, "--file", str(fds["code"]), f"{WORKDIR}/main.py", "--remount-ro", "/"]
        argv += ["--chdir", WORKDIR, "--clearenv"]
        env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}  # fmt: skip
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--seccomp", str(fds["seccomp"]), "--info-fd", str(fds["info"]), "--as-pid-1"]
        # sh is the PID namespace's init: it waits for the code only, then exits, and the kernel
        # kills whatever the code left behind (bwrap's own init would wait for every process)
        return [*argv, "--", "/usr/bin/sh", "-c", f"{self.found.root.python} -I main.py; exit $?"]

    def run(self, code: str, wall_s: float | None = None) -> SandboxResult:
        wall_s = self.limits.wall_s if wall_s is None else wall_s
        host_dir = tempfile.mkdtemp(prefix="lh-sbx-")
        os.chmod(host_dir, 0o711)  # the call's uid passes through to the scratch mount point only
        uid = allocate_uid() if self.as_root else None
        group = None
        opened: list[int] = []
        try:
            if self.layout is not None:
                group = sandbox_cgroup.create(
                    self.layout, self.limits.memory_mb, self.limits.nproc + PIDS_OVERHEAD
                )
            fds = self._open_fds(host_dir, code, opened)
            scratch = os.path.join(host_dir, "scratch") if self.as_root else None
            if scratch:
                os.mkdir(scratch, 0o755)
            cfg = {
                "cgroup_procs": group.procs_files if group else [],
                "scratch": scratch,
                "tmpfs_mb": self.limits.tmpfs_mb,
                "tmpfs_inodes": self.limits.tmpfs_inodes,
                "uid": uid,
                "rlimits": self._rlimits(),
                "argv": self._bwrap_argv(scratch, fds),
            }
            result = self._launch(cfg, host_dir, fds, group, uid, wall_s)
        finally:
            for fd in opened:
                os.close(fd)
            if group is not None:  # nothing of the call can be left (its PID namespace died); check
                group.kill()
                group.remove()
            elif uid is not None:
                kill_uid(uid)
            if uid is not None:
                release_uid(uid)
            shutil.rmtree(host_dir, ignore_errors=True)
        result.host_uid = uid
        return result

    def _open_fds(self, host_dir: str, code: str, opened: list[int]) -> dict[str, int]:
        code_path = os.path.join(host_dir, "code")
        with open(code_path, "wb") as f:
            f.write(code.encode("utf-8", "replace"))
        fds = {"code": os.open(code_path, os.O_RDONLY)}
        opened.append(fds["code"])
        fds["seccomp"] = os.memfd_create("lh-sandbox-seccomp")
        opened.append(fds["seccomp"])
        os.write(fds["seccomp"], self._seccomp)
        os.lseek(fds["seccomp"], 0, os.SEEK_SET)
        fds["info"] = os.open(os.path.join(host_dir, "info"), os.O_WRONLY | os.O_CREAT, 0o600)
        opened.append(fds["info"])
        return fds

    def _launch(self, cfg, host_dir, fds, group, uid, wall_s) -> SandboxResult:
        out_path, err_path = os.path.join(host_dir, "stdout"), os.path.join(host_dir, "stderr")
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=tuple(fds.values()),
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
            stop = self._wait(proc, group, fds["info"], wall_s)
            if stop is not None:
                self._stop(proc, group, uid, os.path.join(host_dir, "info"))
            proc.wait()
        elapsed = time.monotonic() - start
        started = os.fstat(fds["info"]).st_size > 0
        return self._result(proc.returncode, stop, started, group, out_path, err_path, wall_s, elapsed)

    def _wait(self, proc: subprocess.Popen, group, info_fd: int, wall_s: float) -> str | None:
        """Wait for the call to end (woken by a pidfd at once); "wall", "cpu" or "setup" when a
        limit stopped it. The wall clock starts when bwrap reports the code started (its info
        fd): set-up time on a loaded machine is not the code's."""
        pidfd = os.pidfd_open(proc.pid)
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            begin, code_start = time.monotonic(), None
            while not poller.poll(POLL_S * 1000):
                now = time.monotonic()
                if code_start is None and os.fstat(info_fd).st_size > 0:
                    code_start = now
                if code_start is None and now - begin >= SETUP_TIMEOUT_S:
                    return "setup"
                if code_start is not None and now - code_start >= wall_s:
                    return "wall"
                if group is not None and group.cpu_seconds() >= self.limits.cpu_s:
                    return "cpu"
            return None
        finally:
            os.close(pidfd)

    def _stop(self, proc: subprocess.Popen, group, uid: int | None, info_path: str) -> None:
        """Kill the call. Killing the PID namespace's init (sh) makes the kernel kill the rest and
        lets bwrap reap it, so no zombie of the call outlives the call; the group, the uid and
        bwrap itself are killed only when that does not end it in time (or before it started)."""
        child = _child_pidfd(info_path, proc.pid)
        if child is not None:
            try:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(child, signal.SIGKILL)
            finally:
                os.close(child)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
                return
        if group is not None:
            group.kill()
        elif uid is not None:
            kill_uid(uid)
        proc.kill()

    def _result(self, rc, stop, started, group, out_path, err_path, wall_s, elapsed) -> SandboxResult:
        limit = self.limits.output_chars
        stdout, stderr = read_capped(out_path, limit), read_capped(err_path, limit)
        cpu = group.cpu_seconds() if group is not None else None
        reason = None
        if stop == "wall":
            reason = f"wall-clock timeout after {wall_s:g} s"
        elif stop == "setup":
            reason = f"sandbox did not start within {SETUP_TIMEOUT_S:g} s"
        elif stop == "cpu":
            reason = f"CPU time limit exceeded ({cpu:.1f} s used by all processes together, limit {self.limits.cpu_s} s)"
        elif rc != 0 and group is not None and group.oom_kills() > 0:
            reason = f"memory limit exceeded (all processes together, limit {self.limits.memory_mb} MB)"
        elif not started:
            reason = f"sandbox failed to start (exit status {rc}): {stderr.strip()[-500:]}"
            log.error("bwrap sandbox failed to start: %s", stderr.strip()[-2000:])
        else:
            reason = status_reason(rc)
        code = rc if (reason is None and rc is not None and rc >= 0) else None
        return SandboxResult(code, stdout, stderr, stop == "wall", reason, elapsed, cpu_s=cpu)


def _child_pidfd(info_path: str, parent: int) -> int | None:
    """A pidfd of the sandbox's init (bwrap's info ``child-pid``), if it is still bwrap's child
    (checked after opening the pidfd, so a reused pid is never signalled)."""
    try:
        with open(info_path) as f:
            pid = int(json.load(f)["child-pid"])
        fd = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        ppid = None
    if ppid != parent:
        os.close(fd)
        return None
    return fd
