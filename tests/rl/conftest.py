"""rl tests run on 2 shared cores: one thread (OpenMP spinning on tiny ops costs far more than it gains)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    """A local Ray cluster on loopback for one test module (4 logical CPUs, a small object store)."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})  # fmt: skip
    yield ray
    ray.shutdown()
