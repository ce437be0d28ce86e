"""The wire of the ``nccl`` weight-sync transport: a broadcast process group, learner -> rollout workers.

One group per rollout pool (rl/weight_sync.py builds it, and rebuilds it when the pool's workers
change): rank 0 is the learner (rank 0 of the learner group, the process that holds the gathered
parameters), ranks 1..N the rollout workers. It is built without ``torch.distributed.init_process_group``
(the learner group already owns the default group, and a vLLM engine its own): a ``TCPStore`` whose
master the learner opens on a free port of its node (``port=0``: the OS picks, no race), and a backend
object constructed directly on it, ``ProcessGroupNCCL`` for CUDA tensors or ``ProcessGroupGloo`` for
CPU ones (``BACKENDS``), so the same code runs on CPU (gloo) in the tests.

A bucket travels as one flat buffer per dtype (``flatten_bucket``) plus a ``BucketMeta`` (names,
shapes, dtypes, offsets) that goes through Ray beside it; the receiver allocates the flat buffers from
the metadata, joins the broadcast and takes the tensors back out as views (``unflatten_bucket``).

Failure handling: the store and the group carry ``timeout_s``; a collective a peer never joins raises
after it on every rank instead of hanging (NCCL: blocking wait and communicator abort without killing
the process, ``_nccl_error_env``).

NCCL cannot put two ranks of one group on one GPU: a learner and an engine sharing a device use the
``ipc`` transport (rollout/weight_ipc.py: the same flat buffers, mapped by handle) or ``object_store``;
``distinct_gpus`` says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
"""The group's backend by the device type of its buffers."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how one rank joins a weight-broadcast group (sent to each worker through Ray)."""

    name: str
    host: str
    port: int
    world_size: int
    backend: str  # "nccl" or "gloo"
    timeout_s: float
    rank: int = 0

    def for_rank(self, rank: int) -> GroupSpec:
        return dataclasses.replace(self, rank=rank)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    flat: int  # which flat buffer of the bucket (one per dtype)
    offset: int  # elements into it
    numel: int


@dataclass(frozen=True)
class BucketMeta:
    """One bucket's layout: its flat buffers (dtype name, elements) and the tensors in them."""

    kind: str  # "full" (engine weights) or "adapter" (LoRA tensors, peft's names)
    index: int
    flats: tuple[tuple[str, int], ...]
    tensors: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return sum(n * _dtype(d).itemsize for d, n in self.flats)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def backend_for(device_type: str) -> str:
    if device_type not in BACKENDS:
        raise ValueError(f"no weight-broadcast backend for device type {device_type!r}; one of {sorted(BACKENDS)}")
    return BACKENDS[device_type]


def buffer_device(backend: str, device: torch.device) -> torch.device:
    """Where this rank's flat buffers live: its CUDA device under NCCL, host memory under gloo."""
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"the nccl weight-broadcast backend needs CUDA tensors; this rank's device is {device}")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return torch.device("cpu")


def flatten_bucket(bucket: dict[str, torch.Tensor], kind: str, index: int,
                   device: torch.device) -> tuple[BucketMeta, list[torch.Tensor]]:  # fmt: skip
    """``bucket``'s tensors packed into one flat buffer per dtype on ``device``, and their layout."""
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    order: dict[torch.dtype, int] = {}
    tensors = []
    for name, t in bucket.items():
        flat = order.setdefault(t.dtype, len(order))
        offset = sizes.get(t.dtype, 0)
        tensors.append(TensorMeta(name, tuple(t.shape), flat, offset, t.numel()))
        sizes[t.dtype] = offset + t.numel()
        parts.setdefault(t.dtype, []).append(t.reshape(-1))
    flats = [torch.cat(parts[d]).to(device) for d in order]
    meta = BucketMeta(kind, index, tuple((str(d).removeprefix("torch."), sizes[d]) for d in order), tuple(tensors))
    return meta, flats


def empty_flats(meta: BucketMeta, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=_dtype(d), device=device) for d, n in meta.flats]


def unflatten_bucket(meta: BucketMeta, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bucket's tensors as views into its flat buffers (loading them copies them into the engine)."""
    if len(flats) != len(meta.flats):
        raise ValueError(f"bucket {meta.index}: {len(flats)} flat buffers for a layout of {len(meta.flats)}")
    return {m.name: flats[m.flat][m.offset : m.offset + m.numel].view(m.shape) for m in meta.tensors}


@contextlib.contextmanager
def _nccl_error_env():
    """While a ProcessGroupNCCL is constructed (it reads these then): ``wait`` blocks and raises on the
    timeout, and a failed collective aborts the communicator without tearing the process down (the
    default, 3, kills it: a learner or engine should survive a dead peer and report it)."""
    keys = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def open_store(spec: GroupSpec, is_master: bool):
    """The group's TCPStore: the master (rank 0, ``spec.port`` 0 picks a free port) or a client of it."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if is_master:
        return dist.TCPStore(spec.host, spec.port, None, True, timeout, wait_for_workers=False)
    return dist.TCPStore(spec.host, spec.port, None, False, timeout)


def new_backend(spec: GroupSpec, store, device: torch.device):
    """The backend process group object on ``store`` (blocks until every rank has constructed its own)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(store, spec.rank, spec.world_size, timeout)
    if spec.backend != "nccl":
        raise ValueError(f"weight-broadcast backend must be one of {sorted(BACKENDS.values())}, got {spec.backend!r}")
    nccl = getattr(dist, "ProcessGroupNCCL", None) or getattr(dist.distributed_c10d, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("this torch build has no NCCL (torch.distributed.ProcessGroupNCCL); "
                           "the nccl weight sync needs a CUDA build of torch")  # fmt: skip
    torch.cuda.set_device(device)
    opts = nccl.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    with _nccl_error_env():
        return nccl(store, spec.rank, spec.world_size, opts)


class BroadcastGroup:
    """One rank's end of a weight-broadcast group; rank 0 sends, every other rank receives."""

    def __init__(self, spec: GroupSpec, device: torch.device, store=None) -> None:
        self.spec = spec
        self.device = buffer_device(spec.backend, device)
        self.store = store if store is not None else open_store(spec, is_master=False)
        self.pg = new_backend(spec, self.store, self.device)

    def broadcast(self, flats: list[torch.Tensor]) -> None:
        """Rank 0's ``flats`` into every rank's ``flats`` (same shapes and dtypes), one buffer at a time."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        for flat in flats:
            self.pg.broadcast([flat], opts).wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def receive(self, meta: BucketMeta) -> dict[str, torch.Tensor]:
        flats = empty_flats(meta, self.device)
        self.broadcast(flats)
        return unflatten_bucket(meta, flats)

    def close(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(Exception):
                pg.shutdown()
        self.store = None


class WeightReceiver:
    """A rollout worker's end of the group: received buckets, and the adapter tensors collected so far."""

    def __init__(self, spec: GroupSpec, device: torch.device) -> None:
        if spec.rank < 1:
            raise ValueError(f"a rollout worker joins a weight-broadcast group at rank >= 1, got {spec.rank}")
        self.group = BroadcastGroup(spec, device)
        self.adapter: dict[str, torch.Tensor] = {}

    def receive(self, meta: BucketMeta) -> dict[str, torch.Tensor]:
        tensors = self.group.receive(meta)
        if meta.kind == "adapter":
            self.adapter.update(tensors)
        return tensors

    def pop_adapter(self) -> dict[str, torch.Tensor]:
        adapter, self.adapter = self.adapter, {}
        if not adapter:
            raise ValueError("no adapter tensors were received before finishing an adapter broadcast")
        return adapter

    def close(self) -> None:
        self.group.close()


def device_record(device: torch.device) -> dict:
    """What the group's setup needs to know of one rank's device: type, and the GPU's UUID on CUDA (device
    indices are per process under Ray's CUDA_VISIBLE_DEVICES; the UUID names the physical GPU), and the
    host (the ipc transport, rollout/weight_ipc.py, shares memory within one host only)."""
    from rollout.weight_ipc import host_id

    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    return {"type": device.type, "device": str(device), "uuid": uuid, "host": host_id()}


def engine_device(worker) -> dict:
    """A vLLM worker's model device (``collective_rpc`` target)."""
    return device_record(next(worker.model_runner.get_model().parameters()).device)


def group_backend(devices: list[dict]) -> str:
    """nccl when every rank's tensors are on CUDA, else gloo over host buffers (e.g. CPU engines)."""
    return "nccl" if all(d["type"] == "cuda" for d in devices) else "gloo"


def distinct_gpus(devices: list[dict], names: list[str]) -> None:
    """Raise when two ranks of an NCCL group sit on one GPU (NCCL cannot put two ranks on one device)."""
    seen: dict[str, str] = {}
    for d, who in zip(devices, names):
        if d["uuid"] in seen:
            raise ValueError(f"learner.weight_sync=nccl: {seen[d['uuid']]} and {who} are on the same GPU "
                             f"({d['uuid']}); NCCL cannot put two ranks of one group on one device. Give every "
                             "engine a GPU of its own (rollout.worker_num_gpus=1, besides the learner's); a "
                             "learner colocated with its engine on one GPU should use the same-GPU or the "
                             "in-process paths (learner.weight_sync=ipc: CUDA IPC, no copy through the host; "
                             "object_store or directory)")  # fmt: skip
        seen[d["uuid"]] = who
