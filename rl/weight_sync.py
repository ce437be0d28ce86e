"""Weight sync: the learner's newest policy version onto every rollout worker, as one component.

``WeightSync.push(pool)`` sends the learner's current weights (its version) to every worker of the pool;
``WeightSync.pull(workers)`` brings replacement workers (started from the pool's start directory) to the
newest version. What travels is chosen by LoRA: full weights (adapters merged in), or with
``learner.lora.sync=adapter`` the adapter tensors only (the engines fold them into the frozen base they
started from, rollout/adapters.py). How it travels is the transport (``learner.weight_sync``):

- ``directory``: the learner writes a checkpoint directory under ``run.dir`` (``weights/vNNNNNN``; a
  sharded learner writes it shard by shard, one gathered bucket at a time) and every worker loads it in
  place; a replacement worker starts from the newest directory (the single learner's behaviour so far).
- ``object_store``: the learner gathers its parameters in buckets of ``learner.sync_bucket_mb`` and yields
  them one by one into Ray's object store (a streaming generator); each bucket is loaded by every worker
  before the learner's next one is waited for, so neither side holds more than a bucket or two of the
  model in host memory and no file is written. A replacement worker starts from the start directory and
  is streamed the newest weights.
- ``nccl``: a broadcast process group of its own between the learner (rank 0 of the learner group, the
  process that gathers the full parameters) and every worker of the pool (rollout/weight_broadcast.py):
  a ``TCPStore`` the learner opens on a free port of its node, handed to the workers through Ray, and a
  ``ProcessGroupNCCL`` (every end on CUDA) or ``ProcessGroupGloo`` (otherwise: CPU engines, the CPU
  tests) built on it directly, without ``init_process_group`` (the learner group owns the default
  group). The learner gathers its parameters in buckets of ``learner.sync_bucket_mb`` exactly as for
  ``object_store`` (copies of the same tensors, LoRA merge included, so every transport gives the same
  bits; under NCCL without LoRA the copies are made on its GPU, as for ``ipc``, not in host memory),
  packs each bucket into one flat buffer per dtype (on its GPU under NCCL), yields the bucket's
  metadata (names, shapes, dtypes, offsets) through a Ray streaming generator and broadcasts it; each
  worker allocates the buffers from the metadata, joins the broadcast and loads the bucket in place
  (``RolloutWorker.receive_weight_bucket``, the object store's load path). The group is built at the
  first push and rebuilt when the pool's workers change; a replacement worker is ``pull``-ed through a
  group of its own (learner + the new workers), after which the next push rebuilds the pool's. Every
  collective carries ``learner.sync_timeout_s``: a worker that dies or never joins makes the sync raise,
  naming the worker, instead of hanging; the broken group is dropped and rebuilt at the next sync.
  NCCL cannot put two ranks on one GPU: every engine needs a GPU of its own (``rollout.worker_num_gpus=1``;
  the learner reserves its GPU), and a learner colocated with its engine on one GPU uses ``ipc`` (or
  ``object_store`` / ``directory``); the setup refuses a shared GPU by name. A push that
  (re)builds the group counts the setup in its ``perf/sync_s``. On GPUs, bench/weight_sync_gpu.py checks
  and times it against the other two transports (NCCL is not exercised by the CPU tests).
- ``ipc``: the learner and its engines on one GPU (colocated: ``learner.num_gpus=0.5
  rollout.worker_num_gpus=0.5``), or CPU learner and engines on one host (the CPU tests). Rank 0 gathers
  the same buckets as for ``object_store`` (LoRA merge included, on the host; without LoRA the gathered
  copies stay on the learner's GPU), packs each into one flat buffer per
  dtype on its device (``flatten_bucket``, the nccl wire's layout) and sends the workers handles to
  those buffers, not their bytes (rollout/weight_ipc.py): a CUDA IPC handle (``reduce_tensor``) on a
  GPU, the name of a shared-memory file on the CPU. Each worker maps the learner's memory, loads the
  bucket in place from it (``RolloutWorker.load_ipc_bucket``, the object store's load path) and drops the
  mapping before it answers; rank 0 frees a buffer only once every worker has answered for it. The
  driver steps rank 0 bucket by bucket (``open_weight_ipc`` / ``next_weight_ipc`` / ``close_weight_ipc``):
  rank 0 packs bucket k + 1 while the workers load bucket k, so at most two buckets are alive on the
  learner's device. Every answer is bounded by ``learner.sync_timeout_s``: a worker that dies or hangs
  mid-sync makes the push raise naming it (the version is not adopted, as for ``object_store``), and
  rank 0's stream is closed (its remaining gathers drained, so a sharded group stays in step; its
  buffers freed). The setup refuses, by name and GPU UUIDs, a worker on another GPU (CUDA IPC maps the
  same device only: use ``nccl`` there) or another host.

Every push returns a ``SyncReport``; its metrics (``perf/sync_s``: seconds of the whole version's sync,
export included; ``sync/version``; ``sync/buckets``) go into the step's row of metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rl.config import LearnerConfig

TRANSPORTS = ("directory", "object_store", "nccl", "ipc")


@dataclass
class SyncReport:
    """One version's sync: what was sent and how long it took."""

    version: int
    seconds: float
    adapter_only: bool
    buckets: int = 0
    path: str | None = None  # the directory transport's version directory

    def metrics(self) -> dict[str, float]:
        return {
            "perf/sync_s": self.seconds,
            "sync/version": float(self.version),
            "sync/buckets": float(self.buckets),
        }


def _is_actor(w) -> bool:
    return hasattr(getattr(w, "update_weights", None), "remote")


class WeightSyncError(RuntimeError):
    """A sync that failed, naming where (a rollout worker by its index in the synced list, or the learner)."""


def _on_all(workers: list, method: str, *args) -> list:
    """``method`` on every worker: in parallel for actors, in turn for in-process workers."""
    import ray

    if all(_is_actor(w) for w in workers):
        return ray.get([getattr(w, method).remote(*args) for w in workers])
    return [
        getattr(w, method)(*(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args))
        for w in workers
    ]


class WeightSync:
    """The learner -> rollout workers path (see the module docstring)."""

    def __init__(self, learner, cfg: LearnerConfig, weights_dir: str | Path) -> None:
        if cfg.weight_sync not in TRANSPORTS:
            raise ValueError(f"learner.weight_sync must be one of {TRANSPORTS}, got {cfg.weight_sync!r}")
        self.learner, self.transport = learner, cfg.weight_sync
        self.adapter_only = cfg.lora.enabled and cfg.lora.sync == "adapter"
        self.bucket_bytes = int(cfg.sync_bucket_mb * 2**20)
        self.timeout_s = float(cfg.sync_timeout_s)
        self.weights_dir = Path(weights_dir)
        self.latest: SyncReport | None = None
        self.group: _Group | None = None  # the nccl transport's broadcast group, over the last synced workers
        self.ipc_checked: set = set()  # the ipc transport: workers (by _member_key) able to map its buffers
        self.learner_device: dict | None = None

    def start_weights(self, renderer=None) -> tuple[str, str | None, int]:
        """(model directory the engines start from, adapter directory or None, version): the current
        weights as a directory, or with adapter-only sync the frozen base plus the current adapter."""
        from rl.rollouts import prepare_model_dir

        update = self.learner.export_weights(str(self.weights_dir))
        adapter = update.path if update.adapter_only else None
        base = self.learner.export_base_weights(str(self.weights_dir.with_name(self.weights_dir.name + "_base"))) \
            if adapter else update  # fmt: skip
        self.latest = SyncReport(update.version, 0.0, update.adapter_only, path=update.path)
        return prepare_model_dir(base.path, renderer), adapter, update.version

    def push(self, pool) -> SyncReport:
        """The learner's current version onto every worker of ``pool`` (its bookkeeping updated)."""
        t0 = time.time()
        report = self._send(pool.workers)
        report.seconds = time.time() - t0
        pool.adopt(
            report.version, report.path if self.transport == "directory" else None, report.adapter_only
        )
        self.latest = report
        return report

    def pull(self, workers: list) -> None:
        """Replacement workers, started from the pool's start directory, onto the newest version."""
        if not workers or self.latest is None:
            return
        if self.transport == "directory":  # they started from the newest full directory already
            if self.latest.adapter_only:
                _on_all(workers, "update_weights", self.latest.path, self.latest.version, True)
            return
        self._send(workers)

    # ------------------------------------------------------------------ transports
    def _send(self, workers: list) -> SyncReport:
        if self.transport == "directory":
            update = self.learner.export_weights(str(self.weights_dir))
            _on_all(workers, "update_weights", update.path, update.version, update.adapter_only)
            return SyncReport(update.version, 0.0, update.adapter_only, buckets=1, path=update.path)
        if self.transport == "nccl":
            return self._broadcast(workers)
        if self.transport == "ipc":
            return self._share(workers)
        return self._stream(workers)

    def _stream(self, workers: list) -> SyncReport:
        import ray

        version = self.learner.version
        if self.adapter_only:
            from rollout.adapters import AdapterWeights

            head, others = self.learner.weight_stream("adapter", self.bucket_bytes)
            tensors = {k: v for ref in head for k, v in ray.get(ref).items()}  # adapters: a few MB
            ray.get(others)
            adapter = AdapterWeights(tensors, **self.learner.adapter_scale_fields())
            _on_all(workers, "update_weights", ray.put(adapter), version, True)
            return SyncReport(version, 0.0, True, 1)
        head, others = self.learner.weight_stream("full", self.bucket_bytes)
        buckets, count = 0, 0
        for ref in head:  # the learner gathers bucket k + 1 while the workers load bucket k
            counts = _on_all(workers, "load_weight_bucket", ref)
            count += int(counts[0])
            buckets += 1
            del ref
        ray.get(others)
        _on_all(workers, "finish_weight_update", version, count)
        return SyncReport(version, 0.0, False, buckets)

    # ------------------------------------------------------------------ the ipc transport
    def _share(self, workers: list) -> SyncReport:
        """The learner's buckets shared by handle with ``workers`` (on its GPU or host), one at a time."""
        self._check_ipc(workers)
        version = self.learner.version
        kind = "adapter" if self.adapter_only else "full"
        name = f"weight-ipc-{uuid.uuid4().hex[:12]}"
        opened, others = self.learner.weight_ipc(name, kind, self.bucket_bytes)
        buckets, count, lead, t = 0, 0, "the learner (rank 0)", self.timeout_s
        try:
            _get(opened, lead, self.timeout_s, "ipc")
            pending = self.learner.sender_call("next_weight_ipc", name, -1)
            while (bucket := _get(pending, lead, self.timeout_s * 2, "ipc")) is not None:
                # rank 0 frees bucket k - 1 (every worker answered for it) and packs k + 1 while they load k
                pending = self.learner.sender_call("next_weight_ipc", name, bucket.meta.index - 1)
                counts = _on_each(workers, "load_ipc_bucket", [(bucket,)] * len(workers), t, "ipc")
                count += int(counts[0])
                buckets += 1
                del bucket
            _get(self.learner.sender_call("close_weight_ipc", name), lead, self.timeout_s * 2, "ipc")
            _get(others, "the learner's other ranks", self.timeout_s * 2, "ipc")
        except BaseException:
            self._abandon_ipc(name, others)
            raise
        if kind == "adapter":
            fields = self.learner.adapter_scale_fields()
            _on_each(workers, "finish_ipc_adapter", [(version, fields)] * len(workers), t, "ipc")
        else:
            _on_each(workers, "finish_weight_update", [(version, count)] * len(workers), t, "ipc")
        return SyncReport(version, 0.0, kind == "adapter", buckets)

    def _abandon_ipc(self, name: str, others: list) -> None:
        """After a failed ipc sync: rank 0 closes the stream (drains its remaining gathers, frees its buffers)
        and the other ranks finish theirs, waited on a bounded time; best effort, the failure is raised."""
        import ray

        with contextlib.suppress(Exception):
            ray.get([self.learner.sender_call("close_weight_ipc", name), *others], timeout=self.timeout_s * 2)

    def _check_ipc(self, workers: list) -> None:
        """Refuse workers that cannot map the learner's buffers (another GPU or host), before any bucket;
        each worker is asked once."""
        from rollout.weight_ipc import check_same_device

        new = [(i, w) for i, w in enumerate(workers) if _member_key(w) not in self.ipc_checked]
        if not new:
            return
        if self.learner_device is None:
            self.learner_device = _get(self.learner.sender_call("weight_device"), "the learner", None, "ipc")
        # no timeout: a replacement worker may still be starting its engine
        devices = _on_each([w for _, w in new], "weight_device", [()] * len(new), None, "ipc")
        check_same_device(self.learner_device, devices, [f"rollout worker {i}" for i, _ in new])
        self.ipc_checked.update(_member_key(w) for _, w in new)

    # ------------------------------------------------------------------ the nccl transport
    def _broadcast(self, workers: list) -> SyncReport:
        """The learner's buckets broadcast over the group of ``workers`` (built or rebuilt first)."""
        group = self._group_for(workers)
        version = self.learner.version
        kind = "adapter" if self.adapter_only else "full"
        head, others = self.learner.weight_broadcast(group.name, kind, self.bucket_bytes)
        buckets, count = 0, 0
        try:
            for ref in head:  # bucket k's metadata, yielded as the learner enters bucket k's broadcast
                meta = _get(ref, "the learner (rank 0)", self.timeout_s * 2)
                counts = _on_each(
                    workers, "receive_weight_bucket", [(meta,)] * len(workers), self.timeout_s * 2
                )
                count += int(counts[0])
                buckets += 1
            _get(others, "the learner's other ranks", self.timeout_s * 2)
            if kind == "adapter":
                fields = self.learner.adapter_scale_fields()
                _on_each(
                    workers, "finish_adapter_broadcast", [(version, fields)] * len(workers), self.timeout_s
                )
            else:
                _on_each(workers, "finish_weight_update", [(version, count)] * len(workers), self.timeout_s)
        except BaseException:
            self._drop_group()  # a failed collective leaves the group unusable: the next sync builds a new one
            raise
        return SyncReport(version, 0.0, kind == "adapter", buckets)

    def _group_for(self, workers: list) -> _Group:
        """The broadcast group of the learner and exactly ``workers``: the current one, or a new one."""
        keys = tuple(_member_key(w) for w in workers)
        if self.group is not None and self.group.members == keys:
            return self.group
        self._drop_group()
        self.group = _open_group(self.learner, workers, self.timeout_s)
        self.group.members = keys
        return self.group

    def _drop_group(self) -> None:
        """Tear the current group down on every end, best effort (an end may be dead or still blocked)."""
        group, self.group = self.group, None
        if group is None:
            return
        group.close(self.learner)

    def close(self) -> None:
        """Release the nccl transport's group (a no-op for the other transports)."""
        self._drop_group()


@dataclass
class _Group:
    """The driver's record of one broadcast group: its name, spec and the workers (by identity) in it."""

    name: str
    backend: str
    workers: list
    members: tuple = field(default_factory=tuple)

    def close(self, learner) -> None:
        # never waited on: a dead worker, or one still blocked in a collective, must not block this;
        # best effort: the group is abandoned either way
        for w in self.workers:
            with contextlib.suppress(Exception):
                if _is_actor(w):
                    w.leave_weight_group.remote()
                else:
                    w.leave_weight_group()
        with contextlib.suppress(Exception):
            learner.sender_call("close_weight_group", self.name)


def _open_group(learner, workers: list, timeout_s: float) -> _Group:
    """A new group: the devices of every end decide the backend (``group_backend``); the learner opens the
    store on its node and every end constructs its backend object (they block until all have joined)."""
    from rollout.weight_broadcast import GroupSpec, distinct_gpus, group_backend

    names = ["the learner"] + [f"rollout worker {i}" for i in range(len(workers))]
    # no timeout here: a replacement worker may still be starting its engine (minutes on a GPU); the
    # group's timeout is for the collectives, from the join on
    devices = [_get(learner.sender_call("weight_device"), names[0], None)]
    devices += _on_each(workers, "weight_device", [()] * len(workers), None)
    backend = group_backend(devices)
    if backend == "nccl":
        distinct_gpus(devices, names)
    name = f"weight-sync-{uuid.uuid4().hex[:12]}"
    host, port = _get(learner.sender_call("open_weight_group", name, len(workers) + 1, backend, timeout_s),
                      names[0], timeout_s)  # fmt: skip
    spec = GroupSpec(name, host, int(port), len(workers) + 1, backend, timeout_s)
    lead = learner.sender_call("join_weight_group", name)
    try:
        _on_each(
            workers,
            "join_weight_group",
            [(spec.for_rank(i + 1),) for i in range(len(workers))],
            timeout_s * 2,
        )
        _get(lead, names[0], timeout_s * 2)
    except BaseException:
        _Group(name, backend, workers).close(learner)
        raise
    return _Group(name, backend, list(workers))


def _member_key(w) -> object:
    """A worker's identity in a group: its actor id, or the object itself for an in-process worker."""
    actor_id = getattr(w, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else id(w)


def _get(ref, who: str, timeout_s: float | None, transport: str = "nccl"):
    """``ray.get(ref)``; a failure or a wait past ``timeout_s`` (None: no limit) raised as a
    ``WeightSyncError`` naming ``who``."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise WeightSyncError(f"weight sync ({transport}): {who} did not answer within {timeout_s:.0f} s") \
            from e  # fmt: skip
    except Exception as e:
        raise WeightSyncError(f"weight sync ({transport}) failed on {who}: {e}") from e


def _on_each(workers: list, method: str, args: list[tuple], timeout_s: float | None,
             transport: str = "nccl") -> list:  # fmt: skip
    """``method(*args[i])`` on every worker at once (the ends of a collective must all be in it): actors
    through Ray, in-process workers on threads. The first failure is raised naming its worker."""
    from concurrent.futures import ThreadPoolExecutor

    refs: dict[int, object] = {}
    local = [i for i, w in enumerate(workers) if not _is_actor(w)]
    for i, w in enumerate(workers):
        if _is_actor(w):
            refs[i] = getattr(w, method).remote(*args[i])
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}
    if local:
        with ThreadPoolExecutor(len(local)) as pool:
            futures = {i: pool.submit(getattr(workers[i], method), *args[i]) for i in local}
            for i, f in futures.items():
                try:
                    results[i] = f.result(timeout=timeout_s)
                except Exception as e:  # named and re-raised below
                    errors[i] = e
    for i, ref in refs.items():
        try:
            results[i] = _get(ref, f"rollout worker {i}", timeout_s, transport)
        except WeightSyncError as e:
            errors[i] = e
    if errors:
        i = min(errors)
        e = errors[i]
        if isinstance(e, WeightSyncError):
            raise e
        raise WeightSyncError(f"weight sync ({transport}) failed on rollout worker {i} ({method}): {e}") \
            from e  # fmt: skip
    return [results[i] for i in range(len(workers))]


# ----------------------------------------------------------------------------- the learner's end
# One rank-0 learner process holds the sending end of each group it opened, by name (a Ray actor's
# process state; rl/learner.py's ``*_weight_group`` methods call these).
_SENDERS: dict[str, dict] = {}


def open_sender(name: str, world_size: int, backend: str, timeout_s: float, device) -> tuple[str, int]:
    """Open group ``name``'s store on a free port of this node; returns (host, port) for the workers."""
    from rollout.weight_broadcast import GroupSpec, open_store

    close_sender(name)
    host = _node_ip()
    spec = GroupSpec(name, host, 0, world_size, backend, timeout_s)
    store = open_store(spec, is_master=True)
    _SENDERS[name] = {"spec": GroupSpec(name, host, int(store.port), world_size, backend, timeout_s),
                      "store": store, "device": device, "group": None}  # fmt: skip
    return host, int(store.port)


def join_sender(name: str) -> None:
    """Construct rank 0's backend object (blocks until every worker has joined)."""
    from rollout.weight_broadcast import BroadcastGroup

    s = _sender(name)
    s["group"] = BroadcastGroup(s["spec"], s["device"], store=s["store"])


def broadcast_buckets(name: str, buckets, kind: str):
    """For each bucket: flatten it (one buffer per dtype), yield its metadata, broadcast it."""
    from rollout.weight_broadcast import flatten_bucket

    group = _sender(name)["group"]
    if group is None:
        raise RuntimeError(f"weight-broadcast group {name!r} was opened but never joined")
    for k, bucket in enumerate(buckets):
        meta, flats = flatten_bucket(bucket, kind, k, group.device)
        yield meta
        group.broadcast(flats)
        del flats


def sender_device(name: str):
    """Where group ``name``'s flat buffers live on the learner: its GPU under NCCL, the host under gloo (None
    before the group is joined)."""
    group = _sender(name)["group"]
    return None if group is None else group.device


def close_sender(name: str) -> None:
    s = _SENDERS.pop(name, None)
    if s is not None and s["group"] is not None:
        s["group"].close()


def _sender(name: str) -> dict:
    if name not in _SENDERS:
        raise KeyError(f"no weight-broadcast group {name!r} on this learner (open_weight_group first)")
    return _SENDERS[name]


# One rank-0 learner process holds the stream of each ipc sync in progress, by name: its bucket iterator
# and the flat buffers still shared with workers (rl/learner.py's ``*_weight_ipc`` methods call these).
_IPC_STREAMS: dict[str, dict] = {}


def open_ipc_stream(name: str, buckets, kind: str, device) -> None:
    """Start ipc stream ``name`` over ``buckets`` (the learner's ``weight_buckets``, not iterated yet)."""
    import torch

    from rollout.weight_broadcast import device_record

    close_ipc_stream(name)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    uuid_ = device_record(device)["uuid"]
    _IPC_STREAMS[name] = {"buckets": iter(buckets), "kind": kind, "device": device, "uuid": uuid_, "live": {},
                          "next": 0}  # fmt: skip


def next_ipc_bucket(name: str, acked: int):
    """Free the flat buffers of buckets ``<= acked`` (every worker has loaded them and dropped its mapping),
    then pack the next bucket on the stream's device and return its ``IpcBucket`` (None when done)."""
    import torch

    from rollout.weight_broadcast import flatten_bucket
    from rollout.weight_ipc import IpcBucket, share_flat

    s = _ipc_stream(name)
    for k in [k for k in s["live"] if k <= acked]:
        del s["live"][k]
    bucket = next(s["buckets"], None)
    if bucket is None:
        return None
    k, device = s["next"], s["device"]
    meta, flats = flatten_bucket(bucket, s["kind"], k, device)
    del bucket
    if device.type == "cuda":  # the copies are done before another process reads the buffers
        torch.cuda.current_stream(device).synchronize()
    handles = tuple(share_flat(f, s["uuid"]) for f in flats)
    s["live"][k], s["next"] = flats, k + 1
    return IpcBucket(meta, handles)


def close_ipc_stream(name: str) -> int:
    """End stream ``name``: free its buffers and drain the buckets not sent (their gathers are collective:
    the other ranks of a sharded learner are in them). Returns the buckets drained."""
    import torch

    s = _IPC_STREAMS.pop(name, None)
    if s is None:
        return 0
    s["live"].clear()
    drained = sum(1 for _ in s["buckets"])
    if s["device"].type == "cuda":
        torch.cuda.ipc_collect()  # blocks a worker still held (e.g. one that died mapped): freed once released
    return drained


def ipc_stream_state(name: str) -> dict:
    """(for tests) the buckets sent so far and the indices of the buffers still alive."""
    s = _ipc_stream(name)
    return {"sent": s["next"], "live": sorted(s["live"])}


def _ipc_stream(name: str) -> dict:
    if name not in _IPC_STREAMS:
        raise KeyError(f"no ipc weight stream {name!r} on this learner (open_weight_ipc first)")
    return _IPC_STREAMS[name]


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
