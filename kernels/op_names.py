"""Names of the custom ops that launch our Triton kernels, by the flavour of the module registering them.

Triton reads TRITON_INTERPRET when it decorates a kernel, and the tests import a kernel module a second time
for the interpreter (``kernels.testing.import_interpreted``). Under one name the later import's launcher would
serve both modules' calls (the dispatcher keeps the last registration), so an interpreted module's ops are
named apart.
"""

from __future__ import annotations

import os


def op_name(name: str) -> str:
    """``longhorizon::name``, with ``_interpreted`` appended when TRITON_INTERPRET=1 (read now: at the import of
    the module that registers the op)."""
    return f"longhorizon::{name}" + ("_interpreted" if os.environ.get("TRITON_INTERPRET") == "1" else "")
