"""Shared helpers for tests/envs: fast sandbox limits and env construction."""

import warnings

import gymnasium

import envs

FAST_SANDBOX = {"cpu_s": 1, "wall_s": 2.0, "memory_mb": 256, "file_mb": 4, "nproc": 16}
ENV_NAMES = sorted(envs.BUILTIN_ENVS)


def make_env(name: str, **kwargs):
    if name == "Python":
        kwargs.setdefault("sandbox_limits", FAST_SANDBOX)
    return gymnasium.make(f"longhorizon/{name}-v0", **kwargs).unwrapped


def strict_warnings():
    """A context in which gymnasium's checker warnings fail the test."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error")
    return ctx
