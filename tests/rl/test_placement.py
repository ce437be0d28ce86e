"""GPU reservations of the learner ranks and rollout workers (rl/placement.py).

Ray schedules on logical resources, so a loopback cluster that declares one GPU shows what a one-GPU
machine does: fractions share it (both actors are handed device 0 at once), and a plan that asks for
more than there is gets refused before any actor starts.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from rl.config import LearnerConfig, RolloutConfig
from rl.placement import check_fits, learner_rank_gpus, placement_error, rollout_worker_gpus


def test_defaults_reserve_nothing_on_a_cpu_cluster_and_whole_gpus_on_a_gpu_one():
    assert learner_rank_gpus(LearnerConfig(), 0) == 0
    assert rollout_worker_gpus(RolloutConfig(), 0) == 0
    assert learner_rank_gpus(LearnerConfig(), 2) == 1
    assert rollout_worker_gpus(RolloutConfig(), 2) == 1
    assert learner_rank_gpus(LearnerConfig(device="cpu"), 2) == 0
    assert learner_rank_gpus(LearnerConfig(device="cuda"), 0) == 1  # then check_fits refuses the plan
    assert check_fits(LearnerConfig(), RolloutConfig(num_workers=3), 4) == 4


def test_colocation_by_fractions_and_clear_refusals():
    half = LearnerConfig(num_gpus=0.5), RolloutConfig(worker_num_gpus=0.5)
    assert check_fits(*half, 1) == 1
    with pytest.raises(ValueError, match=r"reserves 2 GPUs .* the cluster has 1; share GPUs with fractions"):
        check_fits(LearnerConfig(), RolloutConfig(), 1)
    with pytest.raises(ValueError, match="Ray would neither place it on a GPU nor count"):
        learner_rank_gpus(LearnerConfig(num_gpus=0), 1)
    with pytest.raises(ValueError, match="a CPU learner reserves no GPU"):
        learner_rank_gpus(LearnerConfig(device="cpu", num_gpus=1), 1)
    with pytest.raises(ValueError, match="sharded ranks need a whole GPU each"):
        learner_rank_gpus(LearnerConfig(num_workers=2, num_gpus=0.5), 2)
    with pytest.raises(ValueError, match=r"rollout\.worker_num_gpus must be >= 0"):
        rollout_worker_gpus(RolloutConfig(worker_num_gpus=-1), 1)


@pytest.fixture(scope="module")
def ray_one_gpu(tmp_path_factory):
    """A loopback Ray cluster that declares one (logical) GPU."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, num_gpus=1, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", _temp_dir=str(tmp_path_factory.mktemp("ray")))  # fmt: skip
    yield ray
    ray.shutdown()


def test_on_a_one_gpu_cluster_two_half_shares_run_at_once_and_two_whole_gpus_are_refused(ray_one_gpu):
    ray = ray_one_gpu

    @ray.remote
    class Probe:
        def visible(self) -> str | None:
            return os.environ.get("CUDA_VISIBLE_DEVICES")

    learner, worker = LearnerConfig(num_gpus=0.5), RolloutConfig(worker_num_gpus=0.5)
    assert placement_error(learner, worker) is None
    shares = [
        Probe.options(num_cpus=0, num_gpus=g).remote()
        for g in (learner_rank_gpus(learner), rollout_worker_gpus(worker))
    ]
    assert ray.get([p.visible.remote() for p in shares]) == ["0", "0"]  # both on the one GPU, at once
    err = placement_error(LearnerConfig(), RolloutConfig())
    assert err is not None and "reserves 2 GPUs" in err and "the cluster has 1" in err


def test_the_multi_gpu_config_is_refused_on_one_gpu_naming_what_it_needs(ray_one_gpu):
    from rl.config import CONFIGS_ROOT, load_config

    cfg = load_config(CONFIGS_ROOT / "exp" / "gpu_multi.yaml")
    learner, rollout = cfg.learner, cfg.rollout
    assert learner.weight_sync == "nccl" and learner.num_workers > 1 and learner.sharding == "fsdp"
    assert rollout.worker_num_gpus == 1
    err = placement_error(learner, rollout)
    assert err is not None and "reserves 4 GPUs (2 learner rank(s) x 1 + 2 rollout worker(s) x 1)" in err
    assert "the cluster has 1" in err and "ranks take whole GPUs" in err
    # the split it documents for two GPUs still needs two
    one_each = placement_error(
        dataclasses.replace(learner, num_workers=1), dataclasses.replace(rollout, num_workers=1)
    )
    assert one_each is not None and "reserves 2 GPUs" in one_each
