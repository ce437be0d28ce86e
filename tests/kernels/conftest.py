"""Every kernels test runs with NaN-poisoned torch.empty / empty_like / new_empty.

Poisoning is limited to allocations made from the ``kernels`` package: a kernel that reads
memory it never wrote then fails loudly instead of passing on whatever the allocator held.
"""

import pytest

from kernels.testing import nan_poisoned_empty


@pytest.fixture(autouse=True)
def _nan_poisoned_allocations():
    with nan_poisoned_empty(only_prefixes=("kernels",)):
        yield
