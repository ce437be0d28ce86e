"""Where the actors run: the GPUs each learner rank and each rollout worker reserves in Ray.

Ray places actors by what they reserve: an actor that reserves no GPU may land on a node without one,
and the GPUs it uses are not counted, so two actors could fill one GPU unawares (older Ray releases
also hid every GPU from it by setting ``CUDA_VISIBLE_DEVICES=""``). An actor that computes on a GPU reserves
one, or a share of one, and Ray hands it that device (``CUDA_VISIBLE_DEVICES``):

- a learner rank: ``learner.num_gpus``; unset, 1 when the learner runs on CUDA (``learner.device`` cuda,
  or auto on a cluster with GPUs), else 0;
- a rollout worker: ``rollout.worker_num_gpus``; unset, 1 on a cluster with GPUs, else 0.

Fractions place several actors on one GPU (colocation): ``learner.num_gpus=0.5
rollout.worker_num_gpus=0.5`` puts the learner and one engine on a single GPU, the engine's memory then
bounded by ``rollout.engine.gpu_memory_utilization`` (or ``kv_cache_memory_bytes``). A sharded learner's
ranks cannot share a GPU (NCCL refuses two ranks on one device), so they take whole GPUs. A plan that
asks for more GPUs than the cluster has is refused before any actor starts, instead of waiting forever
for resources that never come.
"""

from __future__ import annotations

from rl.config import LearnerConfig, RolloutConfig


def _cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def learner_rank_gpus(cfg: LearnerConfig, cluster_gpus: float | None = None) -> float:
    """GPUs one learner rank reserves (``cluster_gpus``: the connected Ray cluster's when None)."""
    cluster_gpus = _cluster_gpus() if cluster_gpus is None else cluster_gpus
    on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and cluster_gpus >= 1)
    gpus = cfg.num_gpus if cfg.num_gpus is not None else (1.0 if on_cuda else 0.0)
    if gpus < 0:
        raise ValueError(f"learner.num_gpus must be >= 0, got {gpus}")
    if cfg.device == "cpu" and gpus > 0:
        raise ValueError(f"learner.device=cpu with learner.num_gpus={gpus:g}: a CPU learner reserves no GPU")
    if on_cuda and gpus == 0:
        raise ValueError(
            "learner.num_gpus=0 for a learner on CUDA: Ray would neither place it on a GPU nor count the GPU "
            "it uses; reserve a GPU or a share of one (e.g. 0.5 to share it with a rollout worker)"
        )
    if cfg.num_workers > 1 and 0 < gpus < 1:
        raise ValueError(
            f"learner.num_gpus={gpus:g} with learner.num_workers={cfg.num_workers}: sharded ranks need a "
            "whole GPU each (NCCL cannot put two ranks on one device)"
        )
    return gpus


def rollout_worker_gpus(cfg: RolloutConfig, cluster_gpus: float | None = None) -> float:
    """GPUs one rollout worker reserves (``cluster_gpus``: the connected Ray cluster's when None)."""
    cluster_gpus = _cluster_gpus() if cluster_gpus is None else cluster_gpus
    gpus = cfg.worker_num_gpus if cfg.worker_num_gpus is not None else (1.0 if cluster_gpus >= 1 else 0.0)
    if gpus < 0:
        raise ValueError(f"rollout.worker_num_gpus must be >= 0, got {gpus}")
    return gpus


def check_fits(learner: LearnerConfig, rollout: RolloutConfig, cluster_gpus: float | None = None) -> float:
    """The GPUs the run reserves in all; ValueError when the cluster has fewer."""
    cluster_gpus = _cluster_gpus() if cluster_gpus is None else cluster_gpus
    rank, worker = learner_rank_gpus(learner, cluster_gpus), rollout_worker_gpus(rollout, cluster_gpus)
    need = rank * learner.num_workers + worker * rollout.num_workers
    if need > cluster_gpus + 1e-9:
        hint = (
            "share GPUs with fractions, e.g. learner.num_gpus=0.5 rollout.worker_num_gpus=0.5 on one GPU"
            if learner.num_workers == 1
            else "a sharded learner's ranks take whole GPUs: lower learner.num_workers / rollout.num_workers "
            f"or run on a cluster with {need:g} GPUs"
        )
        raise ValueError(
            f"the run reserves {need:g} GPUs ({learner.num_workers} learner rank(s) x {rank:g} + "
            f"{rollout.num_workers} rollout worker(s) x {worker:g}) but the cluster has {cluster_gpus:g}; {hint}"
        )
    return need


def placement_error(learner: LearnerConfig, rollout: RolloutConfig) -> str | None:
    """``check_fits`` on the connected cluster as a message (None: the plan fits)."""
    try:
        check_fits(learner, rollout)
    except ValueError as e:
        return str(e)
    return None
