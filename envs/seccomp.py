"""A seccomp-BPF filter for sandboxed code, compiled here with struct packing (no libseccomp binding).

The program is the raw ``struct sock_filter`` array that ``bwrap --seccomp FD`` loads. It denies
what a code tool never needs and what widens the kernel attack surface:

* every syscall of a foreign ABI (i386 ``int 0x80`` or x32 on x86_64): the process is killed, so the
  number tables below cannot be bypassed through another ABI's numbering;
* ``socket``/``socketpair`` of any family but AF_UNIX, AF_INET, AF_INET6 (``EAFNOSUPPORT``): no
  AF_VSOCK (it shares the host's port space across network namespaces), netlink, packet, ...;
  the sandbox's own network namespace holds only a loopback, and no filesystem socket is bound in;
* the kernel keyring (``keyctl``, ``add_key``, ``request_key``): a channel between calls;
* ``ptrace``, ``process_vm_readv/writev``, ``kcmp``, ``pidfd_getfd``;
* mounts and namespaces inside (``mount``, ``umount2``, ``pivot_root``, ``chroot``, ``unshare``,
  ``setns``, the new mount API, ``clone`` with any ``CLONE_NEW*`` flag); ``clone3`` answers ENOSYS
  so that glibc falls back to ``clone``, whose flags the filter can read;
* ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, modules, kexec, handle-based
  opens, and system-wide settings (clock, hostname, swap, reboot, quota, accounting, syslog).

Denied calls return ``EPERM`` (unless noted); everything else is allowed. ``program()`` builds the
filter for this machine's architecture (x86_64 and aarch64 are known); ``evaluate`` runs a program
on one syscall in Python, so the filter's logic is testable without a kernel.
"""

from __future__ import annotations

import errno
import platform
import struct
import sys
from dataclasses import dataclass

# BPF opcodes (linux/filter.h, linux/bpf_common.h)
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
CLONE_NEW_MASK = (
    0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
)
X32_SYSCALL_BIT = 0x40000000

DENIED = tuple(
    " ".join([
        "keyctl add_key request_key ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd",
        "mount umount2 pivot_root chroot unshare setns fsopen fsconfig fsmount fspick move_mount open_tree",
        "mount_setattr bpf perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register",
        "kexec_load kexec_file_load init_module finit_module delete_module open_by_handle_at",
        "name_to_handle_at acct swapon swapoff reboot sethostname setdomainname quotactl quotactl_fd",
        "lookup_dcookie syslog vhangup personality settimeofday clock_settime clock_adjtime adjtimex",
        "iopl ioperm uselib nfsservctl fanotify_init",
    ]).split()
)  # fmt: skip
"""Syscalls that fail with EPERM (those an architecture lacks are skipped)."""


@dataclass(frozen=True)
class Arch:
    name: str
    audit: int  # AUDIT_ARCH_* as seccomp_data.arch reports it
    numbers: dict[str, int]
    x32: bool = False  # x86_64: numbers with X32_SYSCALL_BIT are the x32 ABI


_X86_64 = Arch("x86_64", 0xC000003E, {
    "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "ptrace": 101, "process_vm_readv": 310,
    "process_vm_writev": 311, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428,
    "mount_setattr": 442, "acct": 163, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170,
    "setdomainname": 171, "quotactl": 179, "quotactl_fd": 443, "lookup_dcookie": 212, "syslog": 103,
    "vhangup": 153, "personality": 135, "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305,
    "adjtimex": 159, "kcmp": 312, "pidfd_getfd": 438, "iopl": 172, "ioperm": 173, "uselib": 134,
    "nfsservctl": 180, "fanotify_init": 300,
}, x32=True)  # fmt: skip
_AARCH64 = Arch("aarch64", 0xC00000B7, {
    "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "ptrace": 117, "process_vm_readv": 270,
    "process_vm_writev": 271, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97,
    "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241,
    "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "open_by_handle_at": 265, "name_to_handle_at": 264,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428,
    "mount_setattr": 442, "acct": 89, "swapon": 224, "swapoff": 225, "reboot": 142, "sethostname": 161,
    "setdomainname": 162, "quotactl": 60, "quotactl_fd": 443, "lookup_dcookie": 18, "syslog": 116,
    "vhangup": 58, "personality": 92, "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266,
    "adjtimex": 171, "kcmp": 272, "pidfd_getfd": 438, "nfsservctl": 42, "fanotify_init": 262,
})  # fmt: skip
ARCHES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}


class UnsupportedArch(RuntimeError):
    """No syscall table for this machine's architecture."""


def host_arch() -> Arch:
    machine = platform.machine().lower()
    if machine not in ARCHES:
        raise UnsupportedArch(
            f"no seccomp syscall table for architecture {machine!r} (known: x86_64, aarch64)"
        )
    return ARCHES[machine]


# --- building -----------------------------------------------------------------------------------------
def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return (code, jt, jf, k & 0xFFFFFFFF)


def _arg_low(i: int) -> int:
    """Offset of the low 32 bits of ``seccomp_data.args[i]`` (nr: 0, arch: 4, ip: 8, args: 16...)."""
    return 16 + 8 * i + (4 if sys.byteorder == "big" else 0)


def _family_block(nr: int) -> list[tuple]:
    """``socket``/``socketpair``: allow the families in ALLOWED_FAMILIES, else EAFNOSUPPORT."""
    inner = [_ins(_LD_W_ABS, _arg_low(0))]
    n = len(ALLOWED_FAMILIES)
    for i, fam in enumerate(ALLOWED_FAMILIES):
        inner.append(_ins(_JEQ_K, fam, jt=n - i, jf=0))  # -> the ALLOW at the end
    inner += [_ins(_RET_K, RET_ERRNO | errno.EAFNOSUPPORT), _ins(_RET_K, RET_ALLOW)]
    return [_ins(_JEQ_K, nr, jt=0, jf=len(inner)), *inner]


def _clone_block(nr: int) -> list[tuple]:
    """``clone`` with any CLONE_NEW* flag (new namespaces) fails with EPERM; plain forks pass."""
    inner = [
        _ins(_LD_W_ABS, _arg_low(0)),
        _ins(_JSET_K, CLONE_NEW_MASK, jt=0, jf=1),
        _ins(_RET_K, RET_ERRNO | errno.EPERM),
        _ins(_RET_K, RET_ALLOW),
    ]
    return [_ins(_JEQ_K, nr, jt=0, jf=len(inner)), *inner]


def instructions(arch: Arch | None = None) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) tuples."""
    arch = arch or host_arch()
    nums = arch.numbers
    prog = [
        _ins(_LD_W_ABS, 4),  # seccomp_data.arch
        _ins(_JEQ_K, arch.audit, jt=1, jf=0),
        _ins(_RET_K, RET_KILL_PROCESS),
        _ins(_LD_W_ABS, 0),  # seccomp_data.nr
    ]
    if arch.x32:
        prog += [_ins(_JGE_K, X32_SYSCALL_BIT, jt=0, jf=1), _ins(_RET_K, RET_KILL_PROCESS)]
    for name in DENIED:
        if name in nums:
            prog += [_ins(_JEQ_K, nums[name], jt=0, jf=1), _ins(_RET_K, RET_ERRNO | errno.EPERM)]
    prog += [_ins(_JEQ_K, nums["clone3"], jt=0, jf=1), _ins(_RET_K, RET_ERRNO | errno.ENOSYS)]
    # the argument blocks load an argument into A, so they come last and always return
    prog += _family_block(nums["socket"]) + _family_block(nums["socketpair"]) + _clone_block(nums["clone"])
    prog.append(_ins(_RET_K, RET_ALLOW))
    return prog


def program(arch: Arch | None = None) -> bytes:
    """The compiled filter: ``struct sock_filter`` entries in native byte order."""
    return b"".join(struct.pack("=HBBI", *ins) for ins in instructions(arch))


def describe() -> str:
    return (
        "socket families other than unix/inet/inet6 (vsock, netlink, packet, ...), keyring, ptrace, "
        "mount/unshare/setns/new namespaces, bpf, perf_event_open, userfaultfd, io_uring, modules, "
        "kexec, system settings; foreign syscall ABIs kill"
    )


# --- checking -----------------------------------------------------------------------------------------
def evaluate(prog: bytes, arch_audit: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """Run the program on one syscall (classic BPF subset used above) and return its action."""
    data = struct.pack("=iIQ6Q", nr, arch_audit, 0, *(list(args) + [0] * (6 - len(args))))
    ins = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while pc < len(ins):
        code, jt, jf, k = ins[pc]
        if code == _LD_W_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == _RET_K:
            return k
        elif code in (_JEQ_K, _JGE_K, _JSET_K):
            hit = acc == k if code == _JEQ_K else acc >= k if code == _JGE_K else bool(acc & k)
            pc += jt if hit else jf
        else:
            raise ValueError(f"unknown BPF opcode {code:#x} at {pc}")
        pc += 1
    raise ValueError("BPF program ran off its end")
