"""Run untrusted Python in a sandbox that holds against hostile code.

``Sandbox(limits).run_python(code)`` runs ``code`` as ``python3 -I main.py`` in a fresh sandbox and
returns a ``SandboxResult`` (exit code, capped stdout/stderr, the reason a limit stopped it).

Backends, chosen by ``backend=``:

* ``"bwrap"`` (envs/sandbox_bwrap.py): bubblewrap with a fresh user namespace per call, new
  mount/PID/network/IPC/UTS/cgroup namespaces, a minimal read-only root (the Python runtime only),
  a seccomp filter (envs/seccomp.py), a tmpfs with size and inode limits, and a cgroup per call
  (envs/sandbox_cgroup.py) so that memory, processes and CPU time are limited for the whole call.
  This is the strong backend.
* ``"unshare"`` / ``"none"`` (envs/sandbox_unshare.py): the weak backends (host filesystem
  visible, per-process limits). Used only when asked for by name, or by ``"auto"`` with
  ``allow_weak=True``.
* ``"auto"`` (default): bwrap when it works here; otherwise the sandbox *refuses* to run code
  (``run_python`` raises ``SandboxUnavailable`` naming the reason and the fix) unless
  ``allow_weak=True`` accepts the weak backend.

``Sandbox.protection`` says which protections are active (the Python env puts it in every step's
info); the first sandbox of a process logs it once (a warning for a weak or refused one).
"""

from __future__ import annotations

import logging
import threading
import time

from envs.sandbox_common import (
    SANDBOX_UIDS,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)
from envs.sandbox_unshare import namespace_mode, sandbox_python

__all__ = [
    "BACKENDS",
    "SANDBOX_UIDS",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "describe",
    "namespace_mode",
    "sandbox_python",
    "strong_backend_reason",
]

log = logging.getLogger(__name__)
BACKENDS = ("auto", "bwrap", "unshare", "none")
_logged: set[tuple] = set()
_log_lock = threading.Lock()


def strong_backend_reason() -> str | None:
    """None when the bwrap backend works here, else why not."""
    from envs import sandbox_bwrap

    found = sandbox_bwrap.probe()
    return None if found.ok else found.reason


class Sandbox:
    """Runs Python code under the limits; one ``run_python`` call = one fresh sandbox."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        use_namespaces: bool = True,
        backend: str = "auto",
        allow_weak: bool = False,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"sandbox backend must be one of {BACKENDS}, got {backend!r}")
        self.limits = limits or SandboxLimits()
        if not use_namespaces:  # the explicit no-namespace fallback (kept for its tests)
            backend = "none"
        self.refusal: str | None = None
        self._impl = self._choose(backend, allow_weak)
        self.backend = self._impl.name if self._impl is not None else "refused"
        self.protection = self._describe()
        self._log_once()

    def _choose(self, backend: str, allow_weak: bool):
        from envs import sandbox_bwrap, sandbox_unshare

        if backend in ("auto", "bwrap"):
            found = sandbox_bwrap.probe()
            if found.ok:
                return sandbox_bwrap.BwrapBackend(self.limits, found)
            if backend == "bwrap" or not allow_weak:
                self.refusal = (
                    f"no strong sandbox available: {found.reason}. The python tool refuses to run code "
                    "without one; install bubblewrap, or accept the weak sandbox explicitly "
                    "(allow_weak_sandbox=True / Sandbox(allow_weak=True))"
                )
                return None
            backend = "unshare"
        return sandbox_unshare.UnshareBackend(self.limits, use_namespaces=backend == "unshare")

    def _describe(self) -> dict:
        if self._impl is None:
            return {
                "backend": "refused",
                "refused": self.refusal,
                "namespaces": [],
                "network": "no code runs",
                "rlimits": "cpu=- (no code runs)",
                "wall_s": self.limits.wall_s,
            }
        return self._impl.describe()

    def _log_once(self) -> None:
        key = (self.backend, self.protection.get("cgroup"), self.protection.get("uid"))
        with _log_lock:
            if key in _logged:
                return
            _logged.add(key)
        if self.backend == "bwrap":
            log.info("sandbox: bwrap; active protections: %s", self.protection)
        elif self.backend == "refused":
            log.warning("sandbox: %s", self.refusal)
        else:
            log.warning(
                "sandbox: WEAK backend %r (accepted by configuration): %s", self.backend, self.protection
            )

    @property
    def available(self) -> bool:
        return self._impl is not None

    def run_python(self, code: str, wall_s: float | None = None) -> SandboxResult:
        """Run ``code``; ``wall_s`` (at most the limits' ``wall_s``) shortens the wall-clock limit,
        e.g. to what is left of a turn's tool time. Raises ``SandboxUnavailable`` when refused."""
        if self._impl is None:
            raise SandboxUnavailable(self.refusal)
        wall = self.limits.wall_s if wall_s is None else max(0.0, min(wall_s, self.limits.wall_s))
        start = time.monotonic()
        result = self._impl.run(code, wall)
        result.wall_s = time.monotonic() - start
        result.protection = self.protection
        return result


def describe(result: SandboxResult) -> str:
    """The tool-result text of one run: stdout, then stderr under a label."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    return "\n".join(parts) if parts else "(no output)"
