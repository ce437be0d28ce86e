"""Tool environments (Gymnasium API in message space), the tool-call protocol, sandbox, registry.

Importing ``envs`` registers the built-in envs with gymnasium (``longhorizon/<Name>-v0``) without
importing their modules; see envs/README.md for writing your own env and reward. ``ToolEnv``,
``Tool``, ``Task``, ``ToolError`` and ``play_episode`` are re-exported lazily.
"""

from typing import Any

from envs.registry import BUILTIN_ENVS, load_object, make, register_builtins

register_builtins()

_LAZY = {
    "ToolEnv": "envs.base",
    "Tool": "envs.base",
    "Task": "envs.base",
    "ToolError": "envs.base",
    "play_episode": "envs.play",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'envs' has no attribute {name!r}")


__all__ = [
    "BUILTIN_ENVS",
    "Task",
    "Tool",
    "ToolEnv",
    "ToolError",
    "load_object",
    "make",
    "play_episode",
    "register_builtins",
]
