"""The strong sandbox holds against hostile code, one test per escape class: host filesystem,
sockets (filesystem, abstract, vsock), memory / CPU time / processes of the whole sandbox (forked
children, SysV shared memory), tmpfs inodes and xattrs, uid and keyring isolation across calls,
denied syscalls, per-turn and per-episode tool time budgets, and refusal without a strong backend.

These run the real bwrap sandbox. Where bubblewrap is missing they FAIL (scripts/setup.sh installs
it as root), they are not skipped: a security test that silently skips proves nothing.
``LH_SANDBOX_TEST_BACKEND=unshare`` runs the attacks against the weak backend instead, to watch
them succeed there.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import itertools
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

import gymnasium
import pytest

from envs import protocol, seccomp
from envs.sandbox import SANDBOX_UIDS, Sandbox, SandboxLimits, strong_backend_reason

BACKEND = os.environ.get("LH_SANDBOX_TEST_BACKEND", "bwrap")
REPO = Path(__file__).resolve().parents[2]
LIMITS = {"cpu_s": 1, "wall_s": 8.0, "memory_mb": 256, "file_mb": 4, "nproc": 16}


@pytest.fixture(scope="module", autouse=True)
def strong_backend():
    if BACKEND == "bwrap":
        reason = strong_backend_reason()
        assert reason is None, f"the bwrap sandbox does not work here: {reason}"


def run(code: str, **limits):
    sandbox = Sandbox(SandboxLimits(**{**LIMITS, **limits}), backend=BACKEND, allow_weak=True)
    return sandbox.run_python(code)


def run_json(code: str, **limits) -> dict:
    result = run(code, **limits)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("{")), None)
    assert line is not None, f"no JSON output: {result}"
    return json.loads(line)


# --- filesystem ---------------------------------------------------------------------------------------
def test_host_files_are_not_visible():
    project_files = [
        str(Path(__file__).resolve()),
        str(REPO / "envs" / "sandbox.py"),
        str(REPO / "pyproject.toml"),
    ]
    etc = ["/etc/hostname", "/etc/passwd", "/etc/hosts", "/etc/resolv.conf", "/etc/os-release"]
    # the checkout's parent too, unless it is a directory the sandbox has its own of (a clone in /tmp)
    parent = [] if str(REPO.parent) in ("/", "/tmp") else [str(REPO.parent)]
    dirs = [
        str(REPO),
        *parent,
        "/home",
        "/root",
        "/run",
        "/var",
        "/sys",
        "/opt",
        "/mnt",
        "/srv",
        "/boot",
    ]
    code = f"""
import json, os
def read(p):
    try:
        with open(p, 'rb') as f:
            return f.read(4000).decode('latin-1')
    except OSError:
        return None
def write(p):
    try:
        open(p, 'w').write('x')
        return True
    except OSError:
        return False
print(json.dumps({{
    "root": sorted(os.listdir('/')), "dev": sorted(os.listdir('/dev')), "usr": sorted(os.listdir('/usr')),
    "files": {{p: read(p) for p in {project_files + etc!r}}},
    "dirs": {{p: os.path.exists(p) for p in {dirs!r}}},
    "write": {{p: write(p) for p in ['/usr/x', '/etc/x', '/x', '/proc/x']}},
}}))
"""
    out = run_json(code)
    for p in project_files:
        assert out["files"][p] is None, f"the sandbox read the project's {p}"
    for p in etc:  # absent, or the sandbox's own synthetic file: never the host's
        host = Path(p).read_text(errors="replace")[:4000] if Path(p).is_file() else None
        assert out["files"][p] is None or out["files"][p] != host, f"the sandbox read the host's {p}"
    assert not any(out["dirs"].values()), {p: v for p, v in out["dirs"].items() if v}
    assert set(out["root"]) <= {"bin", "dev", "etc", "lib", "lib64", "proc", "tmp", "usr"}, out["root"]
    assert set(out["dev"]) <= {"null", "zero", "urandom", "shm", "fd", "stdin", "stdout", "stderr"}, out[
        "dev"
    ]
    assert set(out["usr"]) <= {"bin", "lib", "lib64"}, out["usr"]
    assert not any(out["write"].values()), out["write"]


# --- sockets ------------------------------------------------------------------------------------------
@pytest.fixture
def host_unix_sockets():
    run_dir = Path("/run") if os.access("/run", os.W_OK) else Path("/tmp")
    path = run_dir / f"lh-sandbox-test-{uuid.uuid4().hex}.sock"
    fs_server = socket.socket(socket.AF_UNIX)
    fs_server.bind(str(path))
    path.chmod(0o777)  # world-writable, like the host socket the red team reached
    abstract = f"\0lh-sandbox-test-{uuid.uuid4().hex}"
    abs_server = socket.socket(socket.AF_UNIX)
    abs_server.bind(abstract)
    for s in (fs_server, abs_server):
        s.listen(4)
        s.setblocking(False)
    yield str(path), abstract, (fs_server, abs_server)
    for s in (fs_server, abs_server):
        s.close()
    path.unlink()


def test_host_sockets_and_foreign_families_are_unreachable(host_unix_sockets):
    path, abstract, servers = host_unix_sockets
    code = f"""
import json, socket
out = {{}}
for name, addr in [("fs", {path!r}), ("abstract", {abstract!r})]:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1)
        s.connect(addr)
        out[name] = "connected"
    except OSError as e:
        out[name] = str(e)
for name, fam, kind in [("vsock", 40, socket.SOCK_STREAM), ("netlink", 16, socket.SOCK_RAW),
                        ("packet", 17, socket.SOCK_RAW), ("bluetooth", 31, socket.SOCK_STREAM)]:
    try:
        socket.socket(fam, kind).close()
        out[name] = "created"
    except OSError as e:
        out[name] = e.errno
try:  # the sandbox's own loopback works
    srv = socket.create_server(("127.0.0.1", 0))
    socket.create_connection(srv.getsockname(), timeout=1)
    out["loopback"] = "ok"
except OSError as e:
    out["loopback"] = str(e)
print(json.dumps(out))
"""
    out = run_json(code)
    assert out["fs"] != "connected" and out["abstract"] != "connected", out
    for fam in ("vsock", "netlink", "packet", "bluetooth"):
        assert out[fam] in (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES), (fam, out[fam])
    assert out["loopback"] == "ok"
    for server in servers:
        with pytest.raises(BlockingIOError):
            server.accept()


# --- whole-sandbox limits -----------------------------------------------------------------------------
def test_memory_is_limited_for_the_whole_sandbox_forked_children():
    code = """
import os, time
r, w = os.pipe()
kids = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (150 * 1024 * 1024)  # 150 MB each, written: resident
        os.write(w, b"%d" % i)
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
os.set_blocking(r, False)
ready, dead, t0 = set(), set(), time.time()
while len(ready | dead) < 6 and time.time() - t0 < 6:  # every child has allocated, or died trying
    time.sleep(0.1)
    try:
        ready |= {int(c) for c in os.read(r, 64).decode()}
    except BlockingIOError:
        pass
    dead |= {i for i, p in enumerate(kids) if i not in dead and os.waitpid(p, os.WNOHANG) != (0, 0)}
holding = ready - dead
print("holding", len(holding), flush=True)
"""
    result = run(code, memory_mb=256)
    holding = int(result.stdout.split()[-1]) if "holding" in result.stdout else 0
    assert holding * 150 <= 256, f"{holding} children held {holding * 150} MB at once against a 256 MB limit"


def test_sysv_shared_memory_counts_against_the_sandbox():
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
for i in range(8):
    sid = libc.shmget(0, 100 * 1024 * 1024, 0o1000 | 0o600)  # IPC_PRIVATE | IPC_CREAT, never removed
    if sid < 0:
        break
    addr = libc.shmat(sid, None, 0)
    ctypes.memset(addr, 1, 100 * 1024 * 1024)
    libc.shmdt(ctypes.c_void_p(addr))
    held += 100
    print("held", held, flush=True)
"""
    result = run(code, memory_mb=256)
    held = int(result.stdout.split()[-1]) if "held" in result.stdout else 0
    assert held <= 256, f"{held} MB of SysV shared memory against a 256 MB limit"


def test_cpu_time_is_limited_across_processes():
    code = """
import os, time
for i in range(4):
    if os.fork() == 0:
        last = 0.0
        while True:
            t = time.process_time()
            if t - last > 0.05:
                os.write(1, b"c%d %.3f\\n" % (i, t))
                last = t
for _ in range(4):
    os.wait()
"""
    result = run(code, cpu_s=1, wall_s=30.0)  # the wall limit must not be what stops it
    used: dict[str, float] = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].startswith("c"):
            used[parts[0]] = max(used.get(parts[0], 0.0), float(parts[1]))
    assert sum(used.values()) <= 1.5, f"4 processes used {sum(used.values()):.2f} CPU-s against 1 s: {used}"
    assert result.reason and "CPU time" in result.reason, result


def test_processes_and_threads_are_limited():
    code = """
import os, threading, time
n = 0
try:
    for i in range(100):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    pass
t = 0
try:
    for i in range(100):
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        t += 1
except RuntimeError:
    pass
print("tasks", n + t + 1, flush=True)
"""
    result = run(code, nproc=16, wall_s=3.0)
    tasks = int(result.stdout.split()[-1])
    assert tasks <= 16, f"{tasks} processes and threads against nproc=16"


def test_tmpfs_inodes_and_xattrs_are_limited():
    code = """
import json, os
n = 0
try:
    for i in range(20000):
        open("/tmp/f%d" % i, "w").close()
        n += 1
except OSError:
    pass
for i in range(n):
    os.unlink("/tmp/f%d" % i)
open("/dev/shm/x", "w").close()
stored = 0
try:
    for i in range(1000):  # up to 64 MB of xattrs: kernel memory, not file data
        os.setxattr("/dev/shm/x", "user.a%d" % i, b"v" * 64000)
        stored += 64000
except OSError:
    pass
print(json.dumps({"files": n, "xattr_bytes": stored}))
"""
    out = run_json(code, tmpfs_inodes=2048)
    assert out["files"] < 2048, out
    assert out["xattr_bytes"] <= 4 * 1024 * 1024, out


# --- identity -----------------------------------------------------------------------------------------
def test_uid_and_keyring_are_not_shared_across_calls():
    code = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
key = libc.syscall(nr[0], b"user", b"lh-probe", b"secret", 6, ctypes.c_int(-4))  # add_key(..., @u)
add_errno = ctypes.get_errno()
found = libc.syscall(nr[1], 10, ctypes.c_int(-4), b"user", b"lh-probe", 0)  # KEYCTL_SEARCH @u
print(json.dumps({"uid": os.getuid(), "add": key, "add_errno": add_errno, "found": found}))
"""
    sandbox = Sandbox(SandboxLimits(**LIMITS), backend=BACKEND, allow_weak=True)
    results = [sandbox.run_python(code) for _ in range(3)]
    outs = [json.loads(r.stdout) for r in results]
    host_uids = [r.host_uid for r in results]
    assert all(u in SANDBOX_UIDS for u in host_uids) and len(set(host_uids)) == 3, host_uids
    steps = {b - a for a, b in itertools.pairwise(host_uids)}
    assert steps != {1}, f"sequential host uids are predictable: {host_uids}"
    assert {o["uid"] for o in outs} == {1000}, "the code must see its own user namespace's uid"
    for o in outs:
        assert o["add"] == -1 and o["add_errno"] == errno.EPERM, f"the kernel keyring is reachable: {o}"
        assert o["found"] == -1, f"a key of an earlier call was found: {o}"


def test_dangerous_syscalls_are_denied():
    code = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
x86 = os.uname().machine == "x86_64"
calls = {
    "ptrace_traceme": (101 if x86 else 117, 0, 0, 0, 0),
    "unshare_user": (272 if x86 else 97, 0x10000000),
    "unshare_net": (272 if x86 else 97, 0x40000000),
    "mount": (165 if x86 else 40, b"none", b"/tmp", b"tmpfs", 0, 0),
    "bpf": (321 if x86 else 280, 0, 0, 0),
    "perf_event_open": (298 if x86 else 241, 0, 0, -1, -1, 0),
    "io_uring_setup": (425, 8, 0),
    "clone_newuser": (56 if x86 else 220, 0x10000000 | 17, 0, 0, 0, 0),
    "setns": (308 if x86 else 268, 0, 0),
}
out = {}
for name, (nr, *args) in calls.items():
    rc = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    out[name] = -1 if rc == -1 and ctypes.get_errno() == 1 else rc
print(json.dumps(out))
"""
    out = run_json(code)
    assert all(v == -1 for v in out.values()), {k: v for k, v in out.items() if v != -1}


def test_concurrent_calls_all_complete():
    sandbox = Sandbox(SandboxLimits(**LIMITS), backend=BACKEND, allow_weak=True)

    async def many():
        return await asyncio.gather(
            *(asyncio.to_thread(sandbox.run_python, f"print({i} * 2)") for i in range(8))
        )

    results = asyncio.run(many())
    assert [r.stdout.strip() for r in results] == [str(i * 2) for i in range(8)], [r.reason for r in results]


def test_protections_are_reported():
    sandbox = Sandbox(SandboxLimits(**LIMITS), backend=BACKEND, allow_weak=True)
    prot = sandbox.protection
    assert prot["backend"] == "bwrap"
    assert {"user", "mount", "pid", "net", "ipc", "uts", "cgroup"} <= set(prot["namespaces"])
    assert "vsock" in prot["seccomp"] and "keyring" in prot["seccomp"]
    if os.geteuid() == 0:  # root on a Linux host: per-call cgroups and the inode-limited tmpfs
        assert prot["cgroup"].startswith("cgroup v"), prot["cgroup"]
        assert prot["limits"].startswith("whole sandbox") and "inodes" in prot["private_tmp"]
        assert prot["uid"] == "unprivileged throw-away uid"


def test_active_protections_are_logged_once_per_process(monkeypatch, caplog):
    import envs.sandbox

    monkeypatch.setattr(envs.sandbox, "_logged", set())
    with caplog.at_level(logging.INFO, logger="envs.sandbox"):
        Sandbox(SandboxLimits(**LIMITS), backend=BACKEND, allow_weak=True)
        Sandbox(SandboxLimits(**LIMITS), backend=BACKEND, allow_weak=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "envs.sandbox"]
    assert len(lines) == 1 and "active protections" in lines[0] and "seccomp" in lines[0], lines


# --- refusal ------------------------------------------------------------------------------------------
def test_refuses_without_a_strong_backend_unless_accepted(monkeypatch):
    from envs import sandbox_bwrap

    missing = sandbox_bwrap.BwrapProbe(
        False, "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    )
    monkeypatch.setattr(sandbox_bwrap, "probe", lambda: missing)  # a machine without bwrap
    env = gymnasium.make("longhorizon/Python-v0", sandbox_limits=LIMITS).unwrapped
    _, info = env.reset(seed=0)
    assert info["sandbox"]["backend"] == "refused"
    obs, *_ = env.step(protocol.format_tool_call("python", {"code": "print(1)"}))
    text = obs["messages"][0]["content"]
    assert text.startswith("error: python: no strong sandbox available") and "bubblewrap" in text, text
    weak = gymnasium.make("longhorizon/Python-v0", sandbox_limits=LIMITS, allow_weak_sandbox=True).unwrapped
    _, info = weak.reset(seed=0)
    assert info["sandbox"]["backend"] in ("unshare", "none")
    obs, *_ = weak.step(protocol.format_tool_call("python", {"code": "print(6 * 7)"}))
    assert obs["messages"][0]["content"] == "42"


# --- tool time budgets --------------------------------------------------------------------------------
def _sleep_calls(n: int, seconds: float) -> str:
    code = f"import time\ntime.sleep({seconds})\nprint('slept')"
    return "".join(protocol.format_tool_call("python", {"code": code}) for _ in range(n))


def _python_env(**kwargs):
    kwargs.setdefault("sandbox_limits", {**LIMITS, "wall_s": 10.0, "cpu_s": 5})
    return gymnasium.make(
        "longhorizon/Python-v0", sandbox_backend=BACKEND, allow_weak_sandbox=True, **kwargs
    ).unwrapped


def test_per_turn_tool_budget_bounds_a_turn_of_many_calls():
    env = _python_env(turn_tool_budget_s=1.5)
    env.reset(seed=0)
    t0 = time.monotonic()
    obs, _, _, _, info = env.step(_sleep_calls(4, 2.0))  # 8 s of sleeping, one call after another
    elapsed = time.monotonic() - t0
    texts = [m["content"] for m in obs["messages"]]
    assert elapsed <= 1.5 + 3.0, f"a turn with a 1.5 s tool budget took {elapsed:.1f} s: {texts}"
    assert all("per-turn tool time budget of 1.5 s" in t for t in texts[2:]), texts
    assert len(info["tool_errors"]) >= 2 and env.tool_time_used_s <= elapsed
    # async steps run the calls at once, and cut them at the same deadline
    env.reset(seed=0)
    t0 = time.monotonic()
    obs, *_ = asyncio.run(env.astep(_sleep_calls(4, 8.0)))
    elapsed = time.monotonic() - t0
    assert elapsed <= 1.5 + 3.0, f"async turn took {elapsed:.1f} s"
    assert all("budget of 1.5 s" in m["content"] for m in obs["messages"]), obs["messages"]


def test_per_episode_tool_budget_spans_turns():
    env = _python_env(turn_tool_budget_s=30.0, episode_tool_budget_s=1.5)
    env.reset(seed=0)
    env.step(_sleep_calls(1, 1.0))
    obs, _, _, _, info = env.step(_sleep_calls(1, 2.0))
    assert "per-episode tool time budget of 1.5 s" in obs["messages"][0]["content"], obs["messages"]
    obs, *_ = env.step(_sleep_calls(1, 0.1))
    assert "not run" in obs["messages"][0]["content"] and "per-episode" in obs["messages"][0]["content"]
    _, _, terminated, _, info = env.step(env.expert_action())
    assert terminated and info["solved"], "scoring the answer is not a tool call: not budgeted"
    assert env.tool_time_used_s >= 1.5


# --- the seccomp program itself -------------------------------------------------------------------------
def test_seccomp_program_logic():
    arch = seccomp.host_arch()
    prog, nums = seccomp.program(arch), arch.numbers
    eperm, allow = seccomp.RET_ERRNO | errno.EPERM, seccomp.RET_ALLOW

    def action(name_or_nr, *args, audit=arch.audit):
        nr = nums[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
        return seccomp.evaluate(prog, audit, nr, args)

    assert action("socket", 40, 1) == seccomp.RET_ERRNO | errno.EAFNOSUPPORT  # AF_VSOCK
    assert action("socket", 16, 3) == seccomp.RET_ERRNO | errno.EAFNOSUPPORT  # AF_NETLINK
    assert action("socketpair", 40, 1) == seccomp.RET_ERRNO | errno.EAFNOSUPPORT
    assert all(action("socket", fam, 1) == allow for fam in (1, 2, 10))
    for name in (
        "keyctl",
        "add_key",
        "request_key",
        "ptrace",
        "mount",
        "unshare",
        "setns",
        "bpf",
        "perf_event_open",
    ):
        assert action(name) == eperm, name
    assert action("clone", 0x10000000 | 17) == eperm and action("clone", 0x01200011) == allow  # fork's flags
    assert action("clone3") == seccomp.RET_ERRNO | errno.ENOSYS
    assert action(0) == allow and action(1) == allow  # read, write
    assert action(0, audit=0x40000003) == seccomp.RET_KILL_PROCESS  # i386 ABI
    if arch.x32:
        assert action(seccomp.X32_SYSCALL_BIT | 0) == seccomp.RET_KILL_PROCESS


@pytest.mark.parametrize("arch", sorted({a.name for a in seccomp.ARCHES.values()}))
def test_seccomp_syscall_numbers_match_libseccomp(arch):
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        pytest.skip("libseccomp is not installed: nothing to compare the tables with")
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    table = seccomp.ARCHES[arch]
    for name, nr in table.numbers.items():
        assert lib.seccomp_syscall_resolve_name_arch(table.audit, name.encode()) == nr, (arch, name)


# --- cgroup discovery (the v2 path cannot run on a v1 host: its logic on a fake tree) ------------------
HYBRID_MOUNTINFO = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
33 31 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"""


def test_cgroup_mounts_and_paths_are_parsed():
    from envs.sandbox_cgroup import parse_mountinfo, parse_proc_cgroup

    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    assert [(m[0], m[2]) for m in mounts][-1] == ("cgroup2", "/sys/fs/cgroup/unified") and len(mounts) == 4
    assert {"cpu", "cpuacct"} <= mounts[2][3]
    own = parse_proc_cgroup("4:memory:/process_api/ab\n2:cpu,cpuacct:/\n0::/user.slice/x.scope\n")
    assert own == {"memory": "/process_api/ab", "cpu": "/", "cpuacct": "/", "unified": "/user.slice/x.scope"}


def test_cgroup_v2_layout_on_a_fake_tree(tmp_path, monkeypatch):
    from envs import sandbox_cgroup as cg

    monkeypatch.delenv(cg.DELEGATED_ENV, raising=False)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    mounts = [("cgroup2", "/", str(tmp_path), set())]
    assert "holds processes" in cg._layout_v2(mounts, {"unified": "/system.slice/x.service"})
    layout = cg._layout_v2(mounts, {"unified": "/"})
    parent = tmp_path / cg.PARENT_NAME
    assert layout.version == 2 and layout.parents == {"unified": str(parent)}
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids"
    group = cg.create(layout, 256, 18)
    d = Path(group.dirs["unified"])
    assert (d / "memory.max").read_text() == str(256 * 1024 * 1024) and (d / "pids.max").read_text() == "18"
    assert group.procs_files == [str(d / "cgroup.procs")]
    (d / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.cpu_seconds() == 1.5 and group.oom_kills() == 1
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io\n")
    assert "not available" in cg._layout_v2(mounts, {"unified": "/"})
