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
- ``nccl`` (broadcast from the learner to vLLM workers on GPU, or CUDA IPC on a shared GPU): not
  implemented yet; the config refuses it at start (``rl/config_checks.py``).

Every push returns a ``SyncReport``; its metrics (``perf/sync_s``: seconds of the whole version's sync,
export included; ``sync/version``; ``sync/buckets``) go into the step's row of metrics.jsonl.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rl.config import LearnerConfig

TRANSPORTS = ("directory", "object_store", "nccl")


@dataclass
class SyncReport:
    """One version's sync: what was sent and how long it took."""

    version: int
    seconds: float
    adapter_only: bool
    buckets: int = 0
    path: str | None = None  # the directory transport's version directory

    def metrics(self) -> dict[str, float]:
        return {"perf/sync_s": self.seconds, "sync/version": float(self.version), "sync/buckets": float(self.buckets)}


def _is_actor(w) -> bool:
    return hasattr(getattr(w, "update_weights", None), "remote")


def _on_all(workers: list, method: str, *args) -> list:
    """``method`` on every worker: in parallel for actors, in turn for in-process workers."""
    import ray

    if all(_is_actor(w) for w in workers):
        return ray.get([getattr(w, method).remote(*args) for w in workers])
    return [getattr(w, method)(*(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)) for w in workers]


class WeightSync:
    """The learner -> rollout workers path (see the module docstring)."""

    def __init__(self, learner, cfg: LearnerConfig, weights_dir: str | Path) -> None:
        if cfg.weight_sync not in TRANSPORTS:
            raise ValueError(f"learner.weight_sync must be one of {TRANSPORTS}, got {cfg.weight_sync!r}")
        if cfg.weight_sync == "nccl":
            raise NotImplementedError("learner.weight_sync=nccl is not implemented yet; use directory or object_store")
        self.learner, self.transport = learner, cfg.weight_sync
        self.adapter_only = cfg.lora.enabled and cfg.lora.sync == "adapter"
        self.bucket_bytes = int(cfg.sync_bucket_mb * 2**20)
        self.weights_dir = Path(weights_dir)
        self.latest: SyncReport | None = None

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
        pool.adopt(report.version, report.path if self.transport == "directory" else None, report.adapter_only)
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
