"""Every kernels test runs with NaN-poisoned torch.empty / empty_like / new_empty.

Poisoning is limited to allocations made from the ``kernels`` package: a kernel that reads
memory it never wrote then fails loudly instead of passing on whatever the allocator held.
The tests also run on one intra-op thread: their tensors are tiny, and on a shared 2-core
machine OpenMP threads spinning against other processes made them 5-10x slower.
"""

import pytest
import torch

from kernels.testing import nan_poisoned_empty


@pytest.fixture(autouse=True)
def _nan_poisoned_allocations():
    with nan_poisoned_empty(only_prefixes=("kernels",)):
        yield


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def triton_interpreter():
    """TRITON_INTERPRET=1 for a module: the interpreter also reads it when a kernel launches, not only
    at import (``kernels.testing.import_interpreted``). Triton's interpreter multiplies the raw bit patterns
    of bfloat16 tl.dot operands (triton-lang/triton#11584, closed without a fix; the installed 3.9 and every
    released version have it): they are converted to fp32 first, which is what the tensor cores compute."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def to_fp32(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            data = ti._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return ti.TensorHandle(data, tl.float32)

        return original(self, to_fp32(a), to_fp32(b), d, input_precision, max_num_imprecise_acc)

    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    mp.setattr(ti.InterpreterBuilder, "create_dot", create_dot)
    yield
    mp.undo()
