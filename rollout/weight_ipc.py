"""The wire of the ``ipc`` weight-sync transport: a bucket's flat buffers shared by handle, not by bytes.

The learner (rank 0 of the learner group, the process holding the gathered parameters) packs each bucket
into one flat buffer per dtype on its device (``flatten_bucket``, the nccl wire's layout) and sends the
rollout workers an ``IpcBucket``: the bucket's ``BucketMeta`` and one ``FlatHandle`` per buffer. A worker
maps the learner's memory from the handle (``map_flat``), loads the bucket's tensors in place from views
into it (``unflatten_bucket``) and drops the mapping before it answers; the learner keeps the buffer
alive until every worker has answered (rl/weight_sync.py). What goes through Ray is a few hundred bytes
per buffer, whatever the bucket's size.

- CUDA buffers: ``torch.multiprocessing.reductions.reduce_tensor`` gives ``(rebuild_cuda_tensor, args)``,
  a CUDA IPC memory handle (plus torch's producer/consumer reference counter and an event for the
  producer's stream); ``rebuild_cuda_tensor(*args)`` opens it in the worker. Only a process on the same
  GPU can open it: ``check_same_device`` refuses any other worker at setup, by the GPUs' UUIDs (device
  indices are per process under Ray's ``CUDA_VISIBLE_DEVICES``; the worker maps the handle at its own
  engine's device index, which names the learner's GPU once the UUIDs agree).
- CPU buffers (a CPU learner: the tests): the buffer's storage is moved to a shared-memory file
  (``UntypedStorage._share_filename_cpu_``, torch's ``file_system`` sharing, which needs no file
  descriptor passing) and the worker opens that file by name
  (``UntypedStorage._new_shared_filename_cpu``); the learner and the workers must be on one host.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from rollout.weight_broadcast import BucketMeta, unflatten_bucket

CUDA_DEVICE_ARG = 6
"""Position of the device index in ``rebuild_cuda_tensor``'s arguments (torch 2.x), rewritten on the
receiving end to the worker's own index of the same GPU."""


@dataclass(frozen=True)
class FlatHandle:
    """One flat buffer of a bucket, by reference: how to map it, not its bytes."""

    device_type: str  # "cuda" or "cpu"
    dtype: str
    numel: int
    uuid: str | None = None  # the learner's GPU (cuda)
    rebuild: Callable | None = None  # cuda: torch's rebuild_cuda_tensor
    args: tuple = ()  # cuda: its arguments; cpu: (manager socket, shared file name, bytes)


@dataclass(frozen=True)
class IpcBucket:
    """What a worker is sent for one bucket: its layout and a handle per flat buffer."""

    meta: BucketMeta
    handles: tuple[FlatHandle, ...]


@cache
def host_id() -> str:
    """This machine: hostname and kernel boot id (shared memory and CUDA IPC stay within one host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def share_flat(flat: torch.Tensor, uuid: str | None = None) -> FlatHandle:
    """A handle to ``flat``'s memory for another process of this host (CPU: moved to shared memory first;
    CUDA: the caller has synchronized the stream that wrote it). ``flat`` must stay alive until every
    receiver has dropped its mapping."""
    dtype = str(flat.dtype).removeprefix("torch.")
    if flat.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(flat)
        return FlatHandle("cuda", dtype, flat.numel(), uuid, rebuild, tuple(args))
    if flat.device.type != "cpu":
        raise ValueError(f"the ipc weight sync shares CUDA or CPU buffers, not {flat.device}")
    if flat.storage_offset() != 0 or not flat.is_contiguous():
        raise ValueError("share_flat needs a whole contiguous buffer (flatten_bucket's)")
    manager, name, nbytes = flat.untyped_storage()._share_filename_cpu_()
    return FlatHandle("cpu", dtype, flat.numel(), None, None, (manager, name, int(nbytes)))


def map_flat(handle: FlatHandle, device: torch.device) -> torch.Tensor:
    """The learner's buffer mapped into this process (no copy): on ``device`` (this process's index of
    the learner's GPU) for a CUDA handle, in host memory for a CPU one."""
    dtype = getattr(torch, handle.dtype)
    if handle.device_type == "cpu":
        storage = torch.UntypedStorage._new_shared_filename_cpu(*handle.args)
        return torch.empty(0, dtype=dtype).set_(storage, 0, (handle.numel,), (1,))
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if handle.rebuild is not rebuild_cuda_tensor or len(handle.args) <= CUDA_DEVICE_ARG:
        raise ValueError(f"a CUDA weight handle must come from torch's reduce_tensor, got {handle.rebuild!r}")
    if device.type != "cuda":
        raise ValueError(f"a CUDA weight handle (GPU {handle.uuid}) cannot be mapped on {device}")
    args = list(handle.args)
    args[CUDA_DEVICE_ARG] = torch.cuda.current_device() if device.index is None else device.index
    return handle.rebuild(*args)


def load_mapped(
    bucket: IpcBucket, device: torch.device, load: Callable[[dict[str, torch.Tensor]], Any]
) -> Any:
    """``load(tensors)`` on the bucket's tensors as views into the mapped buffers; when it returns the
    copies are complete (CUDA: the device synchronized) and the mappings are dropped, so the learner may
    free or reuse its buffers once this has answered. ``load`` must not keep the views."""
    flats = [map_flat(h, device) for h in bucket.handles]
    try:
        result = load(unflatten_bucket(bucket.meta, flats))
        if any(h.device_type == "cuda" for h in bucket.handles):
            torch.cuda.synchronize(device)
        return result
    finally:
        flats.clear()  # the last references to the mapped storages: unmapped here


def check_same_device(learner: dict, workers: list[dict], names: list[str]) -> None:
    """Refuse workers that cannot map the learner's buffers: with a CUDA learner every engine must be on
    the learner's GPU (the same UUID); with a CPU learner every worker must be on its host. ``learner``
    and ``workers``: ``rollout.weight_broadcast.device_record``'s (type, device, uuid, host)."""
    for d, who in zip(workers, names):
        if learner["type"] == "cuda" and (d["type"] != "cuda" or d["uuid"] != learner["uuid"]):
            where = f"GPU {d['uuid']}" if d["type"] == "cuda" else f"device {d['device']}"
            raise ValueError(f"learner.weight_sync=ipc: {who} is on {where}, the learner on GPU {learner['uuid']}; "
                             "CUDA IPC maps memory of the same GPU only. Colocate every engine with the learner "
                             "(e.g. learner.num_gpus=0.5 rollout.worker_num_gpus=0.5 on one GPU) or use "
                             "learner.weight_sync=nccl for engines on GPUs of their own")  # fmt: skip
        if d.get("host") != learner.get("host"):
            raise ValueError(f"learner.weight_sync=ipc: {who} is on host {d.get('host')}, the learner on "
                             f"{learner.get('host')}; shared memory stays within one host. Use "
                             "learner.weight_sync=nccl or object_store across hosts")  # fmt: skip
