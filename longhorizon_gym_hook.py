"""Make ``gymnasium.make("longhorizon/<Name>-v0")`` work without a prior ``import envs``.

Gymnasium 1.x has no plugin discovery, so something must register our envs when gymnasium is
imported. ``scripts/setup.sh`` installs a one-line ``.pth`` file that imports this module at
interpreter start-up; it only adds a meta-path finder (no gymnasium or torch import) that, once
``gymnasium`` itself has finished importing, imports ``envs`` (which registers the built-ins and
the ``longhorizon.envs`` entry points with lazy string entry points).
"""

import sys


class _RegisterAfterGymnasium:
    """A meta-path finder (duck-typed, to keep start-up free of importlib.abc)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "gymnasium":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            if "envs" in sys.modules:  # gymnasium was imported by `import envs`, which registers itself
                return
            try:
                import envs

                envs.registry.register_entry_points()
            except Exception as e:  # a broken plug-in must not break `import gymnasium`
                print(f"longhorizon: could not register envs with gymnasium: {e!r}", file=sys.stderr)

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if "gymnasium" in sys.modules or any(isinstance(f, _RegisterAfterGymnasium) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _RegisterAfterGymnasium())


install()
