"""Fixtures for the model tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    """Fixed seed; one intra-op thread: these shapes are tiny, and on a shared 2-core machine
    two threads per op spend most of their time waiting for each other (measured 10x slower)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
