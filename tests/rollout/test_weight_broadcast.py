"""The nccl weight-sync transport's wire (rollout/weight_broadcast.py) on CPU: a real gloo group on loopback.

Buckets survive flatten -> broadcast -> unflatten bit for bit (mixed dtypes, 0-dim tensors); a rank
whose peer never enters a collective gets an error after the group's timeout instead of hanging; the
backend follows the devices and two ranks on one GPU are refused by name. The whole transport, with
real engines, is tests/rl/test_weight_sync.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout.weight_broadcast import (
    BroadcastGroup,
    GroupSpec,
    WeightReceiver,
    distinct_gpus,
    flatten_bucket,
    group_backend,
    open_store,
    unflatten_bucket,
)


def _bucket() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "a.bias": torch.randn(5, generator=g),
        "steps": torch.tensor(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def test_flatten_groups_by_dtype_and_round_trips_bitwise():
    bucket = _bucket()
    meta, flats = flatten_bucket(bucket, "full", 3, torch.device("cpu"))
    assert [d for d, _ in meta.flats] == ["float32", "bfloat16", "int64", "bool"]
    assert [f.dtype for f in flats] == [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    assert dict(meta.flats)["float32"] == 15 + 5 + 0 and meta.index == 3 and meta.kind == "full"
    assert meta.nbytes == sum(t.numel() * t.element_size() for t in bucket.values())
    back = unflatten_bucket(meta, flats)
    assert list(back) == list(bucket)
    for k, t in bucket.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    with pytest.raises(ValueError, match="flat buffers"):
        unflatten_bucket(meta, flats[:2])


def _spec(world: int, timeout_s: float = 20.0) -> tuple[GroupSpec, object]:
    master = GroupSpec("t", "127.0.0.1", 0, world, "gloo", timeout_s)
    store = open_store(master, is_master=True)
    return GroupSpec("t", "127.0.0.1", int(store.port), world, "gloo", timeout_s), store


def _in_threads(fns) -> list:
    out, errors = [None] * len(fns), [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return [e if e is not None else o for o, e in zip(out, errors)]


def test_a_bucket_reaches_every_receiver_bitwise_over_gloo():
    spec, store = _spec(3)
    bucket = _bucket()

    def sender():
        group = BroadcastGroup(spec, torch.device("cpu"), store=store)
        meta, flats = flatten_bucket(bucket, "adapter", 0, group.device)
        metas.append(meta)
        ready.set()
        group.broadcast(flats)
        group.close()

    def receiver(rank):
        def go():
            r = WeightReceiver(spec.for_rank(rank), torch.device("cpu"))
            ready.wait(30)
            r.receive(metas[0])
            got = r.pop_adapter()
            r.close()
            return got

        return go

    metas, ready = [], threading.Event()
    results = _in_threads([sender, receiver(1), receiver(2)])
    assert results[0] is None
    for got in results[1:]:
        assert not isinstance(got, Exception), got
        assert list(got) == list(bucket) and all(torch.equal(got[k], bucket[k]) for k in bucket)


def test_a_peer_that_never_joins_the_broadcast_times_out_instead_of_hanging():
    spec, store = _spec(2, timeout_s=3.0)
    bucket = {"w": torch.ones(4)}

    def sender():
        group = BroadcastGroup(spec, torch.device("cpu"), store=store)
        joined.set()
        _, flats = flatten_bucket(bucket, "full", 0, group.device)
        t0 = time.monotonic()
        try:
            group.broadcast(flats)
        finally:
            waited.append(time.monotonic() - t0)
            release.set()

    def idle_receiver():  # joins the group, then never enters the collective until the sender gave up
        r = WeightReceiver(spec.for_rank(1), torch.device("cpu"))
        joined.wait(30)
        release.wait(60)
        r.close()

    joined, release, waited = threading.Event(), threading.Event(), []
    results = _in_threads([sender, idle_receiver])
    assert isinstance(results[0], RuntimeError), results[0]
    assert 2.0 < waited[0] < 30.0


def test_a_rollout_worker_joins_at_a_rank_above_the_learners():
    spec, _store = _spec(2)
    with pytest.raises(ValueError, match="rank >= 1"):
        WeightReceiver(spec, torch.device("cpu"))


def test_backend_follows_the_devices_and_one_gpu_for_two_ranks_is_refused():
    cpu = {"type": "cpu", "device": "cpu", "uuid": None}
    gpu = lambda u: {"type": "cuda", "device": "cuda:0", "uuid": u}
    assert group_backend([cpu, cpu]) == "gloo"
    assert group_backend([gpu("a"), cpu]) == "gloo"  # a CPU engine: host buffers over gloo
    assert group_backend([gpu("a"), gpu("b")]) == "nccl"
    distinct_gpus([gpu("a"), gpu("b"), gpu("c")], ["the learner", "rollout worker 0", "rollout worker 1"])
    with pytest.raises(ValueError, match=r"the learner and rollout worker 1 are on the same GPU.*in-process path"):
        distinct_gpus([gpu("a"), gpu("b"), gpu("a")], ["the learner", "rollout worker 0", "rollout worker 1"])
