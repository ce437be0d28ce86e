"""Env registry: the in-tree table, gymnasium registration, entry points and "module:attr" strings.

Ways to name an env (``envs.make`` accepts all of them):

* a built-in short name from ``BUILTIN_ENVS`` (``"Calculator"``) or its gymnasium id
  (``"longhorizon/Calculator-v0"``); any other id registered with gymnasium works too;
* the name of an entry point in the ``longhorizon.envs`` group of an installed distribution
  (``[project.entry-points."longhorizon.envs"] myenv = "mypkg.env:MyEnv"``);
* a ``"module:attr"`` string (``"mypkg.env:MyEnv"``), resolved by ``load_object``;
* a class or factory callable.

Gymnasium 1.x has no plugin discovery of its own (the ``gymnasium.envs`` entry-point group of
0.2x was removed). ``scripts/setup.sh`` installs a start-up hook (``longhorizon_gym_hook``) that
imports ``envs`` right after gymnasium, so ``gymnasium.make("longhorizon/Calculator-v0")`` works
as is; in an environment without the hook, ``import envs`` first, or use gymnasium's own
``"module:id"`` form: ``gymnasium.make("envs:longhorizon/Calculator-v0")``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from typing import Any

import gymnasium
from gymnasium.envs.registration import EnvSpec

ENV_GROUP = "longhorizon.envs"
NAMESPACE = "longhorizon"

BUILTIN_ENVS: dict[str, str] = {
    "Calculator": "envs.calculator:CalculatorEnv",
    "Countdown": "envs.countdown:CountdownEnv",
    "Python": "envs.python_env:PythonEnv",
    "RetrievalQA": "envs.retrieval:RetrievalQAEnv",
    "NeedleHaystack": "envs.needle:NeedleHaystackEnv",
    "FrozenLake": "envs.gym_bridge:FrozenLakeTextEnv",
}
"""Built-in envs: short name -> "module:Class". Each is registered as ``longhorizon/<Name>-v0``."""


def load_object(path: str) -> Any:
    """Resolve ``"package.module:attr.sub"`` to the object (the one resolver for every registry)."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"expected a 'module:attr' string, got {path!r}")
    module_name, attr_path = path.split(":")
    if not module_name or not attr_path:
        raise ValueError(f"expected a 'module:attr' string, got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} named in {path!r}: {e}") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{path!r}: {obj!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def gym_id(name: str) -> str:
    return f"{NAMESPACE}/{name}-v0"


def register_builtins() -> None:
    """Register every built-in env with gymnasium (idempotent; env modules are imported lazily)."""
    for name, entry in BUILTIN_ENVS.items():
        if gym_id(name) not in gymnasium.registry:
            gymnasium.register(id=gym_id(name), entry_point=entry, disable_env_checker=True)


def entry_point_envs() -> dict[str, str]:
    """Installed plug-in envs: entry-point name -> "module:attr" (group ``longhorizon.envs``)."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENV_GROUP)}


def register_entry_points() -> list[str]:
    """Register each plug-in env with gymnasium as ``longhorizon/<name>-v0``; returns the new ids."""
    new = []
    for name, value in entry_point_envs().items():
        if gym_id(name) not in gymnasium.registry:
            gymnasium.register(id=gym_id(name), entry_point=value, disable_env_checker=True)
            new.append(gym_id(name))
    return new


def resolve_env(spec: str | type | Callable[..., Any]) -> Callable[..., Any] | str:
    """A factory for ``spec``, or a gymnasium id string when gymnasium should build it."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"env spec must be a non-empty string or a class, got {spec!r}")
    if spec in BUILTIN_ENVS:
        return gym_id(spec)
    if spec in gymnasium.registry:
        return spec
    if ":" in spec:
        attr = spec.split(":", 1)[1]
        # gymnasium's own "module:namespace/Name-v0" form: gymnasium imports the module itself
        return spec if ("/" in attr or re.search(r"-v\d+$", attr)) else load_object(spec)
    plugins = entry_point_envs()
    if spec in plugins:
        return load_object(plugins[spec])
    known = sorted([*BUILTIN_ENVS, *plugins, *(i for i in gymnasium.registry if i.startswith(NAMESPACE))])
    raise ValueError(
        f"unknown env {spec!r}: not a built-in, a gymnasium id, an entry point in "
        f"{ENV_GROUP!r} or a 'module:Class' string. Known: {known}"
    )


def make(spec: str | type | Callable[..., Any], **kwargs: Any) -> Any:
    """Build an env from any of the names above; returns the unwrapped env (``.expert_action()``
    etc. are reachable) with ``env.spec`` set. Keyword arguments go to the env's constructor."""
    register_builtins()
    target = resolve_env(spec)
    if isinstance(target, str):
        return gymnasium.make(target, **kwargs).unwrapped
    if inspect.isclass(target) and not issubclass(target, gymnasium.Env):
        raise TypeError(f"env spec {spec!r} names {target.__name__}, which is not a gymnasium.Env subclass")
    name = spec if isinstance(spec, str) and ":" not in spec else getattr(target, "__name__", "Plugin")
    env_spec = EnvSpec(id=gym_id(name), entry_point=target, disable_env_checker=True)
    env = gymnasium.make(env_spec, **kwargs).unwrapped
    if not isinstance(env, gymnasium.Env):
        raise TypeError(f"env spec {spec!r} built a {type(env).__name__}, not a gymnasium.Env")
    return env
