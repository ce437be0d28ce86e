"""Every weight-sync transport leaves a rollout engine equal to a fresh engine started on the new weights.

A 2-rank sharded learner group (gloo, Ray on loopback) trains a step, ``WeightSync.push`` sends the new
version to a running in-process vLLM worker (directory, then object store, then nccl, which on CPU is
the same code over gloo, then ipc, which on CPU maps the learner's buffers from shared memory; full
weights and LoRA adapter-only), and every weight of that engine's model must equal, bit for bit, the
weights of an engine started fresh from the learner's export of the same version. A replacement worker
started from the start directory and ``pull``-ed lands on the same weights. The nccl transport's group
then survives a dead worker: the sync names it, and the next push rebuilds the group. An ipc sync to a
worker that dies in the middle of it names the worker, tags nothing, and leaves the sharded learner able
to push again.
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
TRANSPORTS = ("directory", "object_store", "nccl", "ipc")


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
        _ipc_worker_dying_mid_sync_is_named(syncs["ipc"], pool, start, want)
        assert [a[0] for a in pool.adopted] == [1, 2, 3, 4, 4, 4]
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


def _ipc_worker_dying_mid_sync_is_named(sync, pool, start, want):
    """A pool of the live worker and an actor worker that exits at its first bucket: the ipc push fails
    naming it and is not adopted; the learner's stream was closed (the 2-rank group's gathers drained), so
    the next push to the live pool lands."""
    import os

    import ray

    from rollout.worker import RolloutWorker

    class DiesAtItsFirstBucket(RolloutWorker):  # local: Ray ships it by value
        def load_ipc_bucket(self, bucket) -> int:
            os._exit(1)

    doomed = ray.remote(num_cpus=0, max_restarts=0)(DiesAtItsFirstBucket).remote(dict(model_path=start, **ENGINE))
    adopted = len(pool.adopted)
    try:
        with pytest.raises(WeightSyncError, match=r"weight sync \(ipc\) failed on rollout worker 1"):
            sync.push(_Workers([pool.workers[0], doomed], pool.version))
    finally:
        ray.kill(doomed)
    assert pool.workers[0].get_version() == pool.version and len(pool.adopted) == adopted
    report = sync.push(pool)
    assert report.version == pool.version and report.buckets >= 1
    got = _engine_weights(pool.workers[0])
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_ipc_transport_is_accepted():
    c = make_cfg("learner.weight_sync=ipc")
    assert c.learner.weight_sync == "ipc" and WeightSync(None, c.learner, "unused").transport == "ipc"


def test_nccl_transport_is_accepted_and_its_settings_checked():
    from rl.config import ConfigError

    c = make_cfg("learner.weight_sync=nccl", "learner.sync_timeout_s=30", "rollout.worker_num_gpus=1")
    assert c.learner.weight_sync == "nccl" and c.learner.sync_timeout_s == 30 and c.rollout.worker_num_gpus == 1
    assert WeightSync(None, c.learner, "unused").transport == "nccl"
    with pytest.raises(ConfigError, match="sync_timeout_s"):
        make_cfg("learner.weight_sync=nccl", "learner.sync_timeout_s=0")
    with pytest.raises(ConfigError, match="worker_num_gpus"):
        make_cfg("rollout.worker_num_gpus=-1")


def _greedy(worker) -> tuple[list[int], list[float]]:
    import ray

    from rollout.worker import TurnRequest

    ask = TurnRequest(session_id="probe", token_ids=[5, 17, 42, 99, 7, 256], max_tokens=6, temperature=0.0)
    out = ray.get(worker.generate.remote([ask]))[0]
    ray.get(worker.end_sessions.remote(["probe"]))
    return out.token_ids, out.logprobs


def _kill(actor) -> None:
    """``ray.kill``, then wait until calls fail (the kill is asynchronous: a ping right after it may
    still be answered, and the pool would see no dead worker)."""
    import time

    import ray

    ray.kill(actor)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.get_version.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.2)
    raise AssertionError("the killed worker still answers after 60 s")


def test_nccl_sync_of_an_actor_pool_survives_a_replaced_worker(ray_local, tmp_path):
    """A WorkerPool of two actor workers on the nccl transport: push; one worker is killed and replaced
    (``replace_dead`` pulls it through a group of its own); the next push rebuilds the pool's group. At
    each version both workers answer a greedy probe with the same tokens and logprobs, which differ from
    the previous version's (the probe sees the weights)."""
    import ray

    from rl.rollouts import WorkerPool

    c = make_cfg(VOCAB, "learner.weight_sync=nccl", "learner.sync_bucket_mb=0.05", "learner.sync_timeout_s=60",
                 "rollout.num_workers=2", "rollout.max_context_tokens=128", "rollout.max_tokens_per_turn=32",
                 "rollout.engine.max_num_seqs=4", f"rollout.engine.kv_cache_memory_bytes={16 << 20}")  # fmt: skip
    shaper = Learner(c.model, c.learner, c.algorithm)
    group = LearnerGroup(c.model, c.learner, c.algorithm)  # one rank: the plain learner actor
    sync = WeightSync(group, c.learner, tmp_path / "weights")
    start, _, version = sync.start_weights()
    pool = WorkerPool(c.rollout, start, version, sync=sync)
    try:
        before = _greedy(pool.workers[0])
        group.train_step(batches_for(shaper, c, make_group(seed=0, n=4)))
        first = sync.push(pool)
        assert first.version == 1 and first.buckets > 1 and sync.group.backend == "gloo"
        v1 = [_greedy(w) for w in pool.workers]
        assert v1[0] == v1[1] != before
        _kill(pool.workers[0])
        assert pool.replace_dead() == [0]
        assert ray.get(pool.workers[0].get_version.remote()) == 1 and _greedy(pool.workers[0]) == v1[1]
        group.train_step(batches_for(shaper, c, make_group(seed=1, n=4)))
        pulled_group = sync.group
        assert sync.push(pool).version == 2 and sync.group is not pulled_group  # rebuilt over the pool
        v2 = [_greedy(w) for w in pool.workers]
        assert v2[0] == v2[1] != v1[1]
        assert ray.get([w.get_version.remote() for w in pool.workers]) == [2, 2]
    finally:
        sync.close()
        pool.shutdown()
        group.shutdown()
