"""How loud the libraries are on the run's console (``run.verbose``).

Left alone, every RL step prints several lines that are not the run's: vLLM's INFO log ("Successfully
reset prefix cache" at every weight sync, a page of engine start-up), transformers' "Writing model
shards" bar at every weight export and its "Loading weights" bar, vLLM's "Loading safetensors
checkpoint shards" bar, library FutureWarnings, and Ray's own INFO lines at start-up. They come from
the actors (other processes), reach the driver through Ray's log forwarding and bury the progress bar.

By default (``run.verbose = false``) the driver therefore starts Ray with

- the Ray logger of the driver at WARNING (``ray.init(logging_level=...)``);
- actor output still forwarded (``log_to_driver=True``): a traceback or error an actor prints must
  reach the console;
- the environment of ``QUIET_ENV`` in the job's runtime env, so that every actor of the run (SFT and
  RL learner, rollout workers, replacements) starts with it: vLLM logs warnings and errors only
  (``VLLM_LOGGING_LEVEL``; the rollout worker also leaves out vLLM's weight-loading bar when vLLM
  logs above INFO), Hugging Face progress bars are off (``HF_HUB_DISABLE_PROGRESS_BARS``, which
  transformers follows), and FutureWarnings (library authors' notes to themselves) are not shown.

A variable already set in the driver's environment (the shell, or ``ray job submit``'s runtime env) is
left as it is: an explicit setting wins, and Ray refuses job and driver runtime envs that set the same
variable. Variables in ``ray.runtime_env.env_vars`` of the config win too. ``run.verbose = true``
sets nothing, which is every library's own default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

QUIET_ENV: dict[str, str] = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore::FutureWarning",
}


def actor_env(verbose: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables the actors get: ``QUIET_ENV`` minus what ``environ`` already sets."""
    if verbose:
        return {}
    environ = os.environ if environ is None else environ
    return {k: v for k, v in QUIET_ENV.items() if k not in environ}


def runtime_env(
    base: Mapping[str, Any] | None, verbose: bool, environ: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """The job's runtime env: ``base`` (``ray.runtime_env``) plus ``actor_env``; base's env_vars win."""
    out = dict(base or {})
    env_vars = {**actor_env(verbose, environ), **dict(out.get("env_vars") or {})}
    if env_vars:
        out["env_vars"] = env_vars
    return out or None


def ray_init_kwargs(
    base_runtime_env: Mapping[str, Any] | None, verbose: bool, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The console-related keyword arguments of ``ray.init``."""
    return {
        "runtime_env": runtime_env(base_runtime_env, verbose, environ),
        "logging_level": logging.INFO if verbose else logging.WARNING,
        "log_to_driver": True,
    }
