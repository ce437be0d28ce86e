"""Tool environments (Gymnasium API in message space), the tool-call protocol, sandbox, registry.

Importing ``envs`` registers the built-in envs with gymnasium (``longhorizon/<Name>-v0``) without
importing their modules; see envs/README.md for writing your own env and reward.
"""

from envs.registry import BUILTIN_ENVS, load_object, make, register_builtins

register_builtins()

__all__ = ["BUILTIN_ENVS", "load_object", "make", "register_builtins"]
