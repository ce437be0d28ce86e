"""The inputs of one module of each kind, recorded during a forward (benchmarks and op counts).

``first_calls(model, kinds)`` hooks the first module of each listed type (in ``model.modules()`` order)
and records the (module, args, kwargs) of its first call while the block runs; the hooks are removed
on exit. Re-running a recorded module on its inputs times or counts that layer kind alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def first_calls(model: nn.Module, kinds: dict[type, str]) -> Iterator[dict[str, tuple | None]]:
    """{kind: (module, args, kwargs) of the first call of the first module of that type, None until it
    runs}, for the kinds ``model`` has; filled while the ``with`` block runs its forward."""
    seen: dict[str, tuple | None] = {}
    hooks = []
    for m in model.modules():
        kind = kinds.get(type(m))
        if kind and kind not in seen:
            seen[kind] = None

            def hook(mod, args, kwargs, kind=kind):
                if seen[kind] is None:
                    seen[kind] = (mod, args, kwargs)

            hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()
