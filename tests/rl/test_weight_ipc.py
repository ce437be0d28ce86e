"""The ipc weight sync's wire and its learner end (rollout/weight_ipc.py, rl/weight_sync.py), on CPU.

The learner's end runs in a Ray actor (another process, as the learner is) and shares its flat buffers
through shared-memory files; this process maps them by name. That the mapping is the learner's memory
and not a copy is shown both ways: a value the learner writes into its buffer after the handle was
sent is seen here, and what crossed Ray is a few hundred bytes for a bucket of megabytes. The learner
keeps at most two buckets alive and frees one only once it was acknowledged. The setup's refusal of a
worker on another GPU or host is checked on device records (no GPU here).
"""

from __future__ import annotations

import pickle

import pytest
import torch

from rollout.weight_ipc import IpcBucket, check_same_device, load_mapped, map_flat

NAMES = ["rollout worker 0", "rollout worker 1"]


def _gpu(uuid: str, host: str = "h") -> dict:
    return {"type": "cuda", "device": "cuda:0", "uuid": uuid, "host": host}


def _cpu(host: str = "h") -> dict:
    return {"type": "cpu", "device": "cpu", "uuid": None, "host": host}


def test_a_worker_on_another_gpu_or_host_is_refused_by_name():
    check_same_device(_gpu("GPU-a"), [_gpu("GPU-a"), _gpu("GPU-a")], NAMES)  # colocated: accepted
    check_same_device(_cpu(), [_cpu(), _cpu()], NAMES)
    check_same_device(_cpu(), [_gpu("GPU-a")], NAMES[:1])  # a CPU learner's shared memory, a GPU engine
    with pytest.raises(
        ValueError, match=r"rollout worker 1 is on GPU GPU-b, the learner on GPU GPU-a.*weight_sync=nccl"
    ):
        check_same_device(_gpu("GPU-a"), [_gpu("GPU-a"), _gpu("GPU-b")], NAMES)
    with pytest.raises(ValueError, match=r"rollout worker 0 is on device cpu, the learner on GPU GPU-a"):
        check_same_device(_gpu("GPU-a"), [_cpu()], NAMES[:1])
    with pytest.raises(ValueError, match=r"rollout worker 1 is on host other, the learner on h"):
        check_same_device(_cpu(), [_cpu(), _cpu("other")], NAMES)


def _sender_class():
    """The learner's end of an ipc stream in an actor of its own (defined here so that Ray ships it by
    value), over buckets of two tensors: ``f{k}`` (``size`` float32 values, all ``k``) and ``i{k}`` (int64)."""
    import ray

    @ray.remote(num_cpus=0)
    class Sender:
        def open(self, name: str, sizes: list[int]) -> None:
            from rl.weight_sync import open_ipc_stream

            buckets = (
                {f"f{k}": torch.full((n,), float(k)), f"i{k}": torch.arange(3) + k}
                for k, n in enumerate(sizes)
            )
            open_ipc_stream(name, buckets, "full", "cpu")

        def next(self, name: str, acked: int):
            from rl.weight_sync import next_ipc_bucket

            return next_ipc_bucket(name, acked)

        def state(self, name: str) -> dict:
            from rl.weight_sync import ipc_stream_state

            return ipc_stream_state(name)

        def write(self, name: str, k: int, value: float) -> None:
            from rl.weight_sync import _IPC_STREAMS

            _IPC_STREAMS[name]["live"][k][0].fill_(value)  # bucket k's float32 buffer, in the learner

        def close(self, name: str) -> int:
            from rl.weight_sync import close_ipc_stream

            return close_ipc_stream(name)

    return Sender


@pytest.mark.ray
def test_a_worker_maps_the_learners_buffer_and_the_learner_frees_it_only_when_acknowledged(ray_local):
    ray = ray_local
    sender = _sender_class().remote()
    sizes = [1 << 20, 1 << 20, 1 << 20, 1000]  # 4 MiB of float32 in each of the first three buckets
    ray.get(sender.open.remote("s", sizes))
    first = ray.get(sender.next.remote("s", -1))
    assert isinstance(first, IpcBucket) and first.meta.index == 0
    assert len(pickle.dumps(first)) < 2048  # handles, not the 4 MiB
    got = load_mapped(first, torch.device("cpu"), lambda t: {k: v.clone() for k, v in t.items()})
    assert torch.equal(got["f0"], torch.zeros(1 << 20)) and torch.equal(got["i0"], torch.arange(3))

    mapped = map_flat(first.handles[0], torch.device("cpu"))  # held past the bucket's load, for the probe
    ray.get(sender.write.remote("s", 0, 7.0))
    assert float(mapped[12345]) == 7.0  # the learner's write after the handle was sent: the same memory
    del mapped

    second = ray.get(sender.next.remote("s", -1))  # bucket 0 not acknowledged yet: both alive
    assert ray.get(sender.state.remote("s")) == {"sent": 2, "live": [0, 1]}
    third = ray.get(sender.next.remote("s", 0))  # bucket 0 acknowledged: freed before bucket 2 is packed
    assert ray.get(sender.state.remote("s")) == {"sent": 3, "live": [1, 2]}
    for b, k in ((second, 1), (third, 2)):
        t = load_mapped(b, torch.device("cpu"), lambda t: {n: v.clone() for n, v in t.items()})
        assert torch.equal(t[f"f{k}"], torch.full((1 << 20,), float(k))) and torch.equal(
            t[f"i{k}"], torch.arange(3) + k
        )
    assert ray.get(sender.close.remote("s")) == 1  # the bucket never sent is drained (a sharded gather)
    with pytest.raises(ray.exceptions.RayTaskError, match="no ipc weight stream 's'"):
        ray.get(sender.state.remote("s"))
    ray.kill(sender)
