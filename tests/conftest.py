"""Fixtures shared by every test directory."""

from __future__ import annotations

import importlib.util
import sys

import pytest


@pytest.fixture(scope="module")
def bench(request):
    """The bench script the test module names in its ``BENCH`` (a path), imported as a module under its
    file name (its dataclasses look their module up in ``sys.modules``), removed again after the module."""
    path = request.module.BENCH
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(path.stem, None)
