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
    at import (``kernels.testing.import_interpreted``)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    yield
    mp.undo()
