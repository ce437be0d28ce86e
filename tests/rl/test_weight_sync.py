"""Every weight-sync transport leaves a rollout engine equal to a fresh engine started on the new weights.

A 2-rank sharded learner group (gloo, Ray on loopback) trains a step, ``WeightSync.push`` sends the new
version to a running in-process vLLM worker (directory, then object store, then nccl, which on CPU is
the same code over gloo; full weights and LoRA adapter-only), and every weight of that engine's model
must equal, bit for bit, the weights of an engine started fresh from the learner's export of the same
version. A replacement worker started from the start directory and ``pull``-ed lands on the same
weights. The nccl transport's group then survives a dead worker: the sync names it, and the next push
rebuilds the group.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_learner import batches_for, make_cfg, make_group

from rl.learner import Learner
from rl.learner_group import LearnerGroup
from rl.weight_sync import WeightSync, WeightSyncError

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

ENGINE = dict(max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
VOCAB = "model.arch.vocab_size=1024"  # the project tokenizer's: the engines load it beside the weights
TRANSPORTS = ("directory", "object_store", "nccl")


def _engine_weights(worker) -> dict[str, torch.Tensor]:
    def grab(w):
        return {k: v.detach().clone() for k, v in w.model_runner.get_model().state_dict().items()}

    return worker.llm.collective_rpc(grab)[0]


def _fresh(path: str):
    from rollout.worker import RolloutWorker

    return RolloutWorker(dict(model_path=path, **ENGINE))


class _Workers:
    """The pool side of a push for in-process workers: the workers and the pool's bookkeeping."""

    def __init__(self, workers, version):
        self.workers, self.version, self.adopted = workers, version, []

    def adopt(self, version, path, adapter_only=False):
        self.version = version
        self.adopted.append((version, path, adapter_only))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_adapter"])
def test_every_transport_gives_a_fresh_engines_weights(ray_local, tmp_path, lora):
    from rl.rollouts import prepare_model_dir

    extra = ("learner.lora.enabled=true", "learner.lora.sync=adapter") if lora else ()
    c = make_cfg(VOCAB, "learner.sync_bucket_mb=0.05", *extra)
    cfg = dataclasses.replace(c.learner, num_workers=2)
    shaper = Learner(c.model, c.learner, c.algorithm)  # only makes the batches (rollout logprobs)
    group = LearnerGroup(c.model, cfg, c.algorithm)
    syncs = {t: WeightSync(group, dataclasses.replace(cfg, weight_sync=t), tmp_path / t / "weights")
             for t in TRANSPORTS}  # fmt: skip
    start, adapter, version = syncs["directory"].start_weights()
    worker = _fresh(start)
    if adapter:
        worker.update_weights(adapter, version, True)
    pool = _Workers([worker], version)
    engines = [worker]
    try:
        for step, transport in enumerate(TRANSPORTS):
            group.train_step(batches_for(shaper, c, make_group(seed=step, n=4)))
            report = syncs[transport].push(pool)
            assert report.version == step + 1 == worker.get_version() and report.seconds > 0
            assert report.adapter_only == lora
            assert report.metrics()["perf/sync_s"] == report.seconds and report.metrics()["sync/version"] == step + 1
            if transport != "directory" and not lora:
                assert report.buckets > 1  # 50 KiB buckets: the model went over in pieces
            merged = group.export_weights(str(tmp_path / "merged"), adapter_only=False)
            fresh = _fresh(prepare_model_dir(merged.path))
            engines.append(fresh)
            want, got = _engine_weights(fresh), _engine_weights(worker)
            assert want.keys() == got.keys()
            bad = [k for k in want if not torch.equal(want[k], got[k])]
            assert not bad, (transport, bad[:5])
            if transport != "directory":  # a replacement worker from the start directory pulls the newest
                new = _fresh(start)
                engines.append(new)
                syncs[transport].pull([new])
                pulled = _engine_weights(new)
                assert all(torch.equal(want[k], pulled[k]) for k in want) and new.get_version() == step + 1
        _dead_worker_is_named_then_the_group_is_rebuilt(syncs["nccl"], pool, tmp_path, want)
        assert [a[0] for a in pool.adopted] == [1, 2, 3, 3]
    finally:
        for e in engines:
            e.shutdown()
        group.shutdown()


def _dead_worker_is_named_then_the_group_is_rebuilt(sync, pool, tmp_path, want):
    """A pool with a dead actor beside the live worker: the nccl sync fails naming it; a push to the live
    pool afterwards builds a new group (the pull left one over the replacement only) and still lands."""
    import ray

    from rollout.worker import RolloutWorker

    dead = ray.remote(num_cpus=0, max_restarts=0)(RolloutWorker).remote({"model_path": str(tmp_path / "none")})
    with pytest.raises(WeightSyncError, match="rollout worker 1"):
        sync.push(_Workers([pool.workers[0], dead], pool.version))
    assert sync.group is None  # the failed group was dropped
    report = sync.push(pool)
    assert sync.group is not None and sync.group.backend == "gloo" and report.version == pool.version
    got = _engine_weights(pool.workers[0])
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_nccl_transport_is_accepted_and_its_timeout_checked():
    from rl.config import ConfigError

    c = make_cfg("learner.weight_sync=nccl", "learner.sync_timeout_s=30")
    assert c.learner.weight_sync == "nccl" and c.learner.sync_timeout_s == 30
    assert WeightSync(None, c.learner, "unused").transport == "nccl"
    with pytest.raises(ConfigError, match="sync_timeout_s"):
        make_cfg("learner.weight_sync=nccl", "learner.sync_timeout_s=0")
