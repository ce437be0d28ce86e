"""Shared helpers for tests/envs: fast sandbox limits and env construction."""

import gymnasium

import envs

FAST_SANDBOX = {"cpu_s": 1, "wall_s": 2.0, "memory_mb": 256, "file_mb": 4, "nproc": 16}
ENV_NAMES = sorted(envs.BUILTIN_ENVS)


def make_env(name: str, **kwargs):
    if name == "Python":
        kwargs.setdefault("sandbox_limits", FAST_SANDBOX)
    return gymnasium.make(f"longhorizon/{name}-v0", **kwargs).unwrapped
