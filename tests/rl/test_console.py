"""run.verbose: what the driver sets, and that it reaches an actor process and the libraries there."""

from __future__ import annotations

import logging
import os

import pytest

from rl import console
from rl.config import RayConfig, load_config


def test_quiet_by_default_and_verbose_sets_nothing():
    cfg = load_config("configs/exp/ci_tiny.yaml")
    assert cfg.run.verbose is False
    assert load_config("configs/exp/ci_tiny.yaml", ["run.verbose=true"]).run.verbose is True
    quiet = console.ray_init_kwargs({}, verbose=False, environ={})
    assert quiet["runtime_env"]["env_vars"]["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert quiet["runtime_env"]["env_vars"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert quiet["logging_level"] == logging.WARNING and quiet["log_to_driver"] is True
    loud = console.ray_init_kwargs({}, verbose=True, environ={})
    assert loud == {"runtime_env": None, "logging_level": logging.INFO, "log_to_driver": True}


def test_explicit_settings_win_over_the_quiet_defaults():
    # a variable set in the driver's environment (shell, ray job submit) is not overridden (and
    # Ray would reject a job env and a driver env setting the same variable)
    env = console.actor_env(False, environ={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert "VLLM_LOGGING_LEVEL" not in env and env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    # the config's own ray.runtime_env keeps its other keys and its env_vars win
    base = {"env_vars": {"PYTHONWARNINGS": "default", "X": "1"}, "working_dir": "."}
    out = console.runtime_env(base, verbose=False, environ={})
    assert out["working_dir"] == "." and out["env_vars"]["X"] == "1"
    assert out["env_vars"]["PYTHONWARNINGS"] == "default"
    assert out["env_vars"]["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert console.runtime_env(base, verbose=True) == base
    assert base == {"env_vars": {"PYTHONWARNINGS": "default", "X": "1"}, "working_dir": "."}  # not mutated


@pytest.mark.parametrize(
    "level, shown", [("WARNING", False), ("error", False), ("INFO", True), ("DEBUG", True)]
)
def test_worker_draws_the_weight_loading_bar_only_when_vllm_logs_info(monkeypatch, level, shown):
    from rollout.worker import vllm_logs_info

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", level)
    assert vllm_logs_info() is shown


@pytest.mark.ray
def test_connect_ray_quiets_the_libraries_in_actor_processes(monkeypatch, tmp_path):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("needs its own Ray session")
    from rl.train import connect_ray

    def _actor_view() -> dict:
        """What a process Ray starts for this job sees: the env and the libraries' resulting settings."""
        import os
        import warnings

        import transformers.utils.logging as hf_logging

        from rl.console import QUIET_ENV
        from rollout.worker import vllm_logs_info

        return {
            "env": {k: os.environ.get(k) for k in QUIET_ENV},
            "hf_progress_bars": hf_logging.is_progress_bar_enabled(),
            "vllm_load_bar": vllm_logs_info(),
            "future_warnings_ignored": any(
                f[0] == "ignore" and f[2] is FutureWarning and f[1] is None for f in warnings.filters
            ),
        }

    for key in console.QUIET_ENV:  # the raylet inherits this process's environment
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connect_ray(RayConfig(num_cpus=1, object_store_memory=80 << 20), verbose=False)
    try:
        view = ray.get(ray.remote(num_cpus=1)(_actor_view).remote(), timeout=120)
    finally:
        ray.shutdown()
    assert all(k not in os.environ for k in console.QUIET_ENV)  # the driver keeps its own console
    assert view["env"] == console.QUIET_ENV
    assert view["hf_progress_bars"] is False  # no "Writing model shards" / "Loading weights" bars
    assert view["vllm_load_bar"] is False
    assert view["future_warnings_ignored"] is True
