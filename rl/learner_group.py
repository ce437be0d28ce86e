"""The learner group: ``learner.num_workers`` Learner actors, one torch.distributed process group.

The driver holds one ``LearnerGroup`` and calls its methods; each call fans out to every rank (the
collectives of FSDP need every rank in every forward, gather and checkpoint) and returns rank 0's
answer, which after the ranks' metric reduction is the group's. With one worker and
``learner.sharding=auto`` it is one plain, unsharded ``Learner`` actor: exactly the single learner
(no process group, same numerics). ``learner.sharding=fsdp`` shards even at one worker (the code path
of a multi-GPU run, at world size 1).

Data: each mini-batch's micro-batches are spread over the ranks balanced by token count (longest
first onto the least-loaded rank, after splitting micro-batches by sequence while there are fewer than
ranks), then every rank is filled up with padding micro-batches (two tokens, zero loss weights) to the
same count: FSDP's gathers need the same number of forwards on every rank, and the loss weights of a
mini-batch are global, so the summed gradient is the mini-batch's whatever the split.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from rl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from rl.learner import Learner, WeightUpdate
from rl.placement import learner_rank_gpus
from rl.types import TrainBatch

SHARDING_MODES = ("auto", "fsdp", "none")


def padding_batch(like: TrainBatch, tokens: int = 2) -> TrainBatch:
    """A ``tokens``-token micro-batch cut from ``like``'s first sequence with every loss weight zero."""
    one = like.select(0, 1)
    n = min(tokens, one.num_tokens)
    cut = {f.name: getattr(one, f.name) for f in dataclasses.fields(one)}
    for name, v in cut.items():
        if isinstance(v, torch.Tensor) and name != "cu_seqlens_N1":
            cut[name] = v[:n].clone()
    cut["cu_seqlens_N1"] = torch.tensor([0, n], dtype=one.cu_seqlens_N1.dtype)
    for name in ("token_weights_T", "advantages_T", "value_weights_T", "rollout_logprobs_T"):
        cut[name] = torch.zeros_like(cut[name])
    cut["loss_mask_T"] = torch.zeros_like(cut["loss_mask_T"])
    cut["value_mask_T"] = torch.zeros_like(cut["value_mask_T"])
    cut["padding"] = True
    return TrainBatch(**cut)


def spread(micro: list[TrainBatch], world: int) -> list[list[TrainBatch]]:
    """One mini-batch's micro-batches over ``world`` ranks, balanced by tokens, padded to equal counts."""
    parts = list(micro)
    while len(parts) < world:
        big = max(range(len(parts)), key=lambda i: (parts[i].num_seqs > 1, parts[i].num_tokens))
        if parts[big].num_seqs < 2:
            break
        half = parts[big].num_seqs // 2
        parts[big : big + 1] = [parts[big].select(0, half), parts[big].select(half, parts[big].num_seqs)]
    ranks: list[list[TrainBatch]] = [[] for _ in range(world)]
    load = [0] * world
    for mb in sorted(parts, key=lambda b: -b.num_tokens):
        r = min(range(world), key=lambda i: (load[i], i))
        ranks[r].append(mb)
        load[r] += mb.num_tokens
    depth = max(len(r) for r in ranks)
    for r in ranks:
        r.extend(padding_batch(parts[0]) for _ in range(depth - len(r)))
    return ranks


def spread_minibatches(minibatches: list[list[TrainBatch]], world: int) -> list[list[list[TrainBatch]]]:
    """Per rank, its share of every mini-batch (``spread``)."""
    per_mb = [spread(mb, world) for mb in minibatches]
    return [[shares[r] for shares in per_mb] for r in range(world)]


class LearnerRank(Learner):
    """One rank of the group: joins the process group, then builds the sharded learner."""

    def __init__(self, model_cfg: ModelConfig, cfg: LearnerConfig, algo: AlgorithmConfig, rank: int,
                 world_size: int, address: tuple[str, int]) -> None:  # fmt: skip
        from rl.learner import _device
        from rl.parallel import init_distributed

        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        d = init_distributed(rank, world_size, address, _device(cfg.device))
        super().__init__(model_cfg, cfg, algo, dist=d)

    def rank(self) -> int:
        return self.dist.rank


class _Rendezvous:
    """The group's store (``rl.parallel.group_store``), held on one node for as long as the group lives."""

    def __init__(self) -> None:
        import ray

        from rl.parallel import group_store

        self.store, self._address = group_store(ray.util.get_node_ip_address())
        self._node = ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[tuple[str, int], str]:
        """Where the store listens, and the node it is on (rank 0 goes there)."""
        return self._address, self._node


class LearnerGroup:
    """The driver's handle on the learner (see the module docstring); every method waits for the ranks."""

    def __init__(self, model_cfg: ModelConfig, cfg: LearnerConfig, algo: AlgorithmConfig) -> None:
        import ray

        if cfg.sharding not in SHARDING_MODES:
            raise ValueError(f"learner.sharding must be one of {SHARDING_MODES}, got {cfg.sharding!r}")
        self.cfg, self.world_size = cfg, cfg.num_workers
        self._rendezvous = None
        self.sharded = cfg.sharding == "fsdp" or (cfg.sharding == "auto" and cfg.num_workers > 1)
        gpus = learner_rank_gpus(cfg)
        if not self.sharded:  # a rank's GPU reservation, as in a sharded group (rl/placement.py)
            self.ranks = [ray.remote(num_cpus=cfg.num_cpus, num_gpus=gpus)(Learner).remote(model_cfg, cfg, algo)]
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._rendezvous = ray.remote(num_cpus=0)(_Rendezvous).remote()
        address, node = ray.get(self._rendezvous.address.remote())
        actor = ray.remote(num_cpus=cfg.num_cpus, num_gpus=gpus)(LearnerRank)
        self.ranks = [
            actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False) if r == 0 else None)
            .remote(model_cfg, cfg, algo, r, self.world_size, address)
            for r in range(self.world_size)
        ]  # fmt: skip
        ray.get([a.rank.remote() for a in self.ranks])  # every rank joined and built (errors surface here)

    # ------------------------------------------------------------------ fan-out helpers
    def _all(self, refs: list) -> Any:
        """Rank 0's result once every rank is done."""
        import ray

        return ray.get(refs)[0]

    # ------------------------------------------------------------------ training
    def train_step(self, minibatches: list[list[TrainBatch]]) -> dict[str, float]:
        if not self.sharded:
            return self._all([self.ranks[0].train_step.remote(minibatches)])
        shares = spread_minibatches(minibatches, self.world_size)
        return self._all([a.train_step.remote(s) for a, s in zip(self.ranks, shares)])

    def sft_step(self, micro_batches: list[TrainBatch]) -> dict[str, float]:
        if not self.sharded:
            return self._all([self.ranks[0].sft_step.remote(micro_batches)])
        shares = spread(micro_batches, self.world_size)
        return self._all([a.sft_step.remote(s) for a, s in zip(self.ranks, shares)])

    def turn_values(self, batch: TrainBatch) -> list[list[float]]:
        return self._all([a.turn_values.remote(batch) for a in self.ranks])

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._all([a.logprobs.remote(batch) for a in self.ranks])

    # ------------------------------------------------------------------ weights and checkpoints
    def export_weights(self, out_dir: str, keep: int = 2, adapter_only: bool | None = None) -> WeightUpdate:
        return self._all([a.export_weights.remote(out_dir, keep, adapter_only) for a in self.ranks])

    def export_base_weights(self, out_dir: str) -> WeightUpdate:
        return self._all([a.export_base_weights.remote(out_dir) for a in self.ranks])

    def save_pretrained(self, out_dir: str) -> str:
        return self._all([a.save_pretrained.remote(out_dir) for a in self.ranks])

    def weight_stream(self, kind: str, bucket_bytes: int | None = None):
        """Rank 0's buckets as a Ray streaming generator of object refs (one bucket each, stored in the
        object store as it is gathered); the other ranks join the gathers; ``finish`` waits for them."""
        head = self.ranks[0].weight_buckets.options(num_returns="streaming").remote(kind, bucket_bytes)
        others = [a.drain_weight_buckets.remote(kind, bucket_bytes) for a in self.ranks[1:]]
        return head, others

    def weight_broadcast(self, group: str, kind: str, bucket_bytes: int | None = None):
        """Rank 0 broadcasting its buckets over weight-broadcast group ``group`` (the nccl transport,
        rl/weight_sync.py): a streaming generator of each bucket's metadata, yielded as rank 0 enters
        that bucket's broadcast; the other ranks join the gathers as for ``weight_stream``."""
        head = self.ranks[0].broadcast_weight_buckets.options(num_returns="streaming").remote(group, kind, bucket_bytes)
        others = [a.drain_weight_buckets.remote(kind, bucket_bytes) for a in self.ranks[1:]]
        return head, others

    def weight_ipc(self, name: str, kind: str, bucket_bytes: int | None = None):
        """Rank 0 opening ipc stream ``name`` of its buckets (the ipc transport, rl/weight_sync.py, steps it
        with ``next_weight_ipc``); the other ranks join the gathers as for ``weight_stream``."""
        opened = self.ranks[0].open_weight_ipc.remote(name, kind, bucket_bytes)
        others = [a.drain_weight_buckets.remote(kind, bucket_bytes) for a in self.ranks[1:]]
        return opened, others

    def sender_call(self, method: str, *args):
        """Rank 0's ``method`` (a weight-broadcast group's sending end) as an object ref, not waited on:
        the group's setup needs rank 0 and the workers in it at once."""
        return getattr(self.ranks[0], method).remote(*args)

    def adapter_scale_fields(self) -> dict:
        return self._all([self.ranks[0].adapter_scale_fields.remote()])

    def state_path(self, path: str) -> str:
        """Where ``save(path)`` writes: ``path`` itself (one file), or sharded the DCP directory beside it
        (``learner.pt`` -> ``learner.dcp/``: each rank's shards plus ``rank_<r>.pt``)."""
        return str(Path(path).with_suffix(".dcp")) if self.sharded else path

    def save(self, path: str) -> None:
        """Full state for exact resume (weights, optimizer, balancer, RNG, counters) at ``state_path``."""
        self._all([a.save.remote(self.state_path(path)) for a in self.ranks])

    def load(self, path: str) -> None:
        """Resume from ``save(path)``'s state; one saved by the other kind (sharded or not) is named."""
        where = Path(self.state_path(path))
        if not where.exists():
            other = Path(path) if self.sharded else Path(path).with_suffix(".dcp")
            hint = f"; {other} is there: it was saved with another learner.num_workers / learner.sharding" \
                if other.exists() else ""  # fmt: skip
            raise FileNotFoundError(f"no learner state at {where}{hint}")
        self._all([a.load.remote(str(where)) for a in self.ranks])

    @property
    def version(self) -> int:
        """The policy version of the weights the learner holds now."""
        return self._all([self.ranks[0].policy_version.remote()])

    def shutdown(self) -> None:
        import ray

        for a in self.ranks:
            ray.kill(a)
        if self._rendezvous is not None:
            ray.kill(self._rendezvous)
