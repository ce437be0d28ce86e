"""Sharding the learner from outside the model: FSDP2, mixed precision, clipping, gathers, DCP checkpoints.

The model stays single-device code; ``shard_learner`` wraps a built ``Learner``'s modules with
``torch.distributed.fsdp.fully_shard`` after its activation checkpointing and LoRA (peft) are in place
and before its optimizer is made (FSDP2 replaces the parameters with DTensors, so AdamW, built after,
steps the local shards).

Units: one per decoder layer and the root (embedding, final norm, LM head, and whatever no unit
claimed). Deviation: ``HybridModel`` calls a layer through its ``attention`` / ``ffn`` methods and its
AttnRes mixes, never through ``layer.forward``, so FSDP's forward hooks on the layer module would not
fire. The per-layer unit is therefore split along those calls: the attention block (``self_attn``),
the FFN block (``block_sparse_moe`` / ``mlp``) and each AttnRes mix are units of their own; a layer's
two RMSNorm weights (2 x hidden floats) fall to the root unit, which stays gathered for the whole
forward. Activation checkpointing wraps ``layer.attention`` / ``layer.ffn`` (rl/learner.py), i.e. the
units sit inside the checkpointed regions; the recompute in backward re-enters the unit's hooks while it
is gathered for backward (tested: the update equals the unsharded one).

Mixed precision (``MixedPrecisionPolicy``): with ``learner.dtype=bfloat16`` on a GPU the gathered
parameters are bf16 for compute while gradients are reduced in fp32 and the sharded parameters (the
master weights AdamW steps) stay fp32; otherwise (CPU, fp32 tests) no cast at all.

Gradient reduction: the loss weights of a mini-batch are normalised over the whole mini-batch
(rl/losses.py), so the mini-batch gradient is the *sum* of the ranks' gradients: the reduce-scatter's
divide factor is set to 1 (FSDP's default would average).

Expert parallelism (``learner.expert_parallel`` = ep > 1): the ranks form a 2-D mesh ``dp`` x ``ep``
(``expert_mesh``; rank = dp index * ep + ep index). Each layer's ``GroupedExperts`` keeps its two stacked
weights [E, ...] as DTensors sharded on dim 0 over ``mesh["ep"]``: a rank materialises only the rows of
its experts [r E/ep, (r+1) E/ep) (r its ep index), and the module gets the all-to-all dispatch of
``kernels.moe.ep.ExpertParallel`` (each rank routes its own tokens on the full E: router, replay and
balancing bias unchanged). The experts are an FSDP unit of their own over ``mesh["dp"]`` (a shard of
the local rows when dp > 1), so their gradients are reduce-scattered (summed, as above) over the ranks
holding the same experts only; over ``ep`` none is needed, every slot of an expert reaches its owner.
Everything else is sharded over the whole group as without EP. The router's load counts stay per rank
and ``merge_routing_stats`` sums them over the whole group, so the bias update is that of all tokens.
Gathers and checkpoints need nothing new: ``full_tensor()`` of a (dp, ep) DTensor is the full [E, ...]
weight (``full_tensors``, the weight export), and DCP saves and reshards DTensors (a checkpoint saved
with ep = 2 loads with ep = 1, tested). The gradient norm is taken per mesh (``clip_grad_norm_``).
LoRA on the routed experts is refused with EP (peft's parameter wrappers are not sharded here).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

DEFAULT_BUCKET_BYTES = 256 << 20
"""Largest host buffer of gathered parameters (one bucket) a weight export or sync holds at once."""


@dataclass(frozen=True)
class Distributed:
    """This process's place in the learner group's process group."""

    rank: int
    world_size: int
    backend: str  # gloo (CPU) or nccl (GPU)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def group_store(host: str = "127.0.0.1") -> tuple[dist.TCPStore, tuple[str, int]]:
    """The group's rendezvous store, listening on ``host`` at a port the OS picks as it binds; its address.

    Whoever calls this keeps the store alive for as long as the group lives (the ranks join it as clients,
    ``init_distributed``). Picking a free port and binding it later, in another process, leaves a window in
    which anything else on the machine can take the port (``EADDRINUSE`` in rank 0); binding port 0 leaves
    none.
    """
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)
    return store, (host, int(store.port))


def init_distributed(rank: int, world_size: int, address: tuple[str, int], device: torch.device) -> Distributed:
    """Join the group whose store listens at ``address`` (``group_store``); blocks until every rank has
    joined. NCCL on a GPU (which it binds), gloo on CPU."""
    backend = backend_for(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        host, port = address
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=default_pg_timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None)  # fmt: skip
    return Distributed(rank, world_size, backend)


def mixed_precision(dtype: str, device: torch.device):
    """bf16 compute / fp32 reduction and master weights for ``dtype=bfloat16`` on a GPU, else no cast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "bfloat16" and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def layer_units(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's FSDP units (see the module docstring): attention, FFN, AttnRes mixes."""
    names = ("self_attn", "block_sparse_moe", "mlp", "attn_res", "mlp_res")
    return [getattr(layer, n) for n in names if isinstance(getattr(layer, n, None), nn.Module)]


# The model's blocks return views (``y.view(B, T, D)``) and FSDP warns that an in-place op on one would
# skip its pre-backward hook; the model adds block outputs out of place (tests: sharded == unsharded).
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def shard_model(root: nn.Module, layers, mp_policy, mesh=None, ep_mesh=None) -> nn.Module:
    """``fully_shard`` every unit of every decoder layer, then ``root``; gradients summed over ranks.
    With ``ep_mesh`` (``expert_mesh``) every layer's routed experts are split over its "ep" dimension
    first (``shard_experts``), the other units are sharded over the whole group as without it."""
    from torch.distributed.fsdp import fully_shard

    with_ep = routed_experts(layers) if ep_mesh is not None else []
    experts = [shard_experts(ex, ep_mesh, mp_policy) for ex in with_ep]
    units = [u for layer in layers for u in layer_units(layer)]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
    fully_shard(root, mesh=mesh, mp_policy=mp_policy)
    for module in (*experts, *units, root):
        module.set_gradient_divide_factor(1.0)  # the loss weights already normalise the mini-batch
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return root


def routed_experts(layers) -> list[nn.Module]:
    """The ``model.moe.GroupedExperts`` of the decoder layers, in layer order."""
    from model.moe import GroupedExperts

    return [m for layer in layers for m in layer.modules() if isinstance(m, GroupedExperts)]


def expert_mesh(d: Distributed, ep: int, device: torch.device):
    """The 2-D ``dp`` x ``ep`` device mesh of expert parallelism: rank = dp index * ep + ep index, so an
    expert-parallel group is ``ep`` consecutive ranks and the ranks holding the same experts (one per
    group) form the ``dp`` sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep < 1 or d.world_size % ep:
        raise ValueError(f"learner.expert_parallel={ep} must divide the learner world size ({d.world_size})")
    return init_device_mesh(device.type, (d.world_size // ep, ep), mesh_dim_names=("dp", "ep"))


def shard_experts(experts: nn.Module, mesh, mp_policy) -> nn.Module:
    """One layer's routed experts split over ``mesh["ep"]`` (the module docstring): each stacked weight
    becomes a DTensor sharded on dim 0 whose local part is this rank's E / ep rows (the other rows are
    dropped here), the module dispatches its slots by all-to-all (``kernels.moe.ep.ExpertParallel``), and
    it is an FSDP unit of its own over ``mesh["dp"]``: its gradients are reduced over the ranks holding
    the same experts only."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from kernels.moe.ep import ExpertParallel

    ep_mesh = mesh["ep"]
    if experts.num_experts % ep_mesh.size():
        raise ValueError(f"learner.expert_parallel={ep_mesh.size()} must divide the model's num_experts "
                         f"({experts.num_experts})")  # fmt: skip
    plan = ExpertParallel(experts.num_experts, ep_mesh.get_group())
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        local = plan.local_rows(full.detach()).clone()
        shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    experts.dispatch = plan
    fully_shard(experts, mesh=mesh["dp"], mp_policy=mp_policy)
    return experts


def shard_learner(learner, d: Distributed) -> None:
    """Shard a Learner's policy (base + LoRA), reference copy and value head, in place."""
    mp = mixed_precision(learner.cfg.dtype, learner.device)
    ep = learner.cfg.expert_parallel
    if ep > 1 and learner.cfg.lora.enabled and learner.cfg.lora.target_parameters:
        raise ValueError("learner.expert_parallel > 1 does not shard LoRA adapters of the routed experts; "
                         "set learner.lora.target_parameters=[]")  # fmt: skip
    ep_mesh = expert_mesh(d, ep, learner.device) if ep > 1 else None
    shard_model(learner.policy, learner.base_model.model.layers, mp, ep_mesh=ep_mesh)
    if learner.reference is not None:
        shard_model(learner.reference, learner.reference.model.layers, mp, ep_mesh=ep_mesh)
    if learner.value_head is not None:
        shard_model(learner.value_head, [], mp)


# --------------------------------------------------------------------------- optimizer step helpers
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm over sharded (DTensor) and plain gradients, then clip: torch's norm of DTensor
    gradients is a partial DTensor, made whole here before the clip coefficient is taken from it. With
    expert parallelism the expert gradients live on another mesh (dp x ep) than the rest (the whole
    group): DTensor ops do not mix meshes, so each mesh's norm is taken (and clipped) on its own."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def gather_objects(obj, d: Distributed | None) -> list:
    """``obj`` of every rank, in rank order (just ``[obj]`` outside a group)."""
    if d is None or d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def reduce_metrics(metrics: dict[str, float], d: Distributed | None, same: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-rank metric sums into the group's: ``*_max`` keys take the max, keys in ``same`` (already the
    group's, e.g. the global gradient norm) rank 0's value, every other key is a sum (the loss metrics are
    weighted by the global loss weights, so their sum is the mini-batch's)."""
    out: dict[str, float] = {}
    for m in gather_objects(metrics, d):
        for k, v in m.items():
            if k in same:
                out.setdefault(k, v)
            else:
                out[k] = max(out[k], v) if k in out and k.endswith("_max") else out.get(k, 0.0) + v
    return out


def merge_routing_stats(gates, d: Distributed | None) -> None:
    """Each MoE router's routing statistics of the step, merged over ranks into every rank (loads and
    token counts summed, exact-QB margins concatenated, histograms summed), so every rank computes the
    same next bias as one rank that saw all tokens. Exact QB needs the margins, which no sum-reduce
    carries (``ExpertBalancer.step(all_reduce=...)`` refuses that mode), hence an object gather."""
    if d is None or d.world_size == 1:
        return
    local = [_stats_to_host(g.pop_stats()) for g in gates]
    every = gather_objects(local, d)
    for i, gate in enumerate(gates):
        parts = [rank[i] for rank in every if rank[i] is not None]
        gate._stats = _merged(parts, gate) if parts else None


def _stats_to_host(stats):
    if stats is None:
        return None
    return {"load_E": stats.load_E.cpu(), "tokens": stats.tokens, "margins": [m.cpu() for m in stats.margins],
            "hist_EB": None if stats.hist_EB is None else stats.hist_EB.cpu(), "hist_range": stats.hist_range}  # fmt: skip


def _merged(parts: list[dict], gate):
    from model.balancing import RoutingStats

    dev = gate.e_score_correction_bias.device  # a buffer: never a DTensor, on the learner's device
    hists = [p["hist_EB"] for p in parts if p["hist_EB"] is not None]
    return RoutingStats(load_E=sum(p["load_E"] for p in parts).to(dev), tokens=sum(p["tokens"] for p in parts),
                        margins=[m.to(dev) for p in parts for m in p["margins"]],
                        hist_EB=sum(hists).to(dev) if hists else None,
                        hist_range=next((p["hist_range"] for p in parts if p["hist_range"] is not None), None))  # fmt: skip


@contextlib.contextmanager
def routing_stats_untouched(gates):
    """A forward inside leaves every router's step statistics as they were (padding micro-batches)."""
    saved = [g._stats for g in gates]
    for g in gates:
        g._stats = None
    try:
        yield
    finally:
        for g, s in zip(gates, saved):
            g._stats = s


# --------------------------------------------------------------------------- gathered weights
def full_tensors(module: nn.Module, d: Distributed | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 keep: Callable[[str], bool] = lambda name: True,
                 device: str | torch.device = "cpu") -> Iterator[dict[str, torch.Tensor]]:  # fmt: skip
    """``module``'s state dict as whole tensors (copies on ``device``, the host unless asked) in buckets of
    at most ``bucket_bytes`` (a tensor larger than that alone), in state-dict order. Every rank must
    iterate (each sharded tensor is an all-gather); only the main rank gets buckets, the others iterate
    over nothing but the gathers."""
    from torch.distributed.tensor import DTensor

    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in module.state_dict().items():
        if not keep(name):
            continue
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if d is not None and not d.is_main:
            continue
        full = full.detach().to(device, copy=True).contiguous()
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = full
        size += nbytes
    if bucket:
        yield bucket


def write_sharded_safetensors(buckets: Iterator[dict[str, torch.Tensor]], path: Path) -> list[str]:
    """An HF sharded checkpoint from buckets (``model-0000k.safetensors`` + index): what vLLM, the rollout
    workers and ``from_pretrained`` read, in ``save_pretrained``'s layout (stacked expert weights written
    per expert, ``model.moe.split_expert_weights``). Returns the files written (none on a non-main rank)."""
    from safetensors.torch import save_file

    from model.moe import split_expert_weights

    path.mkdir(parents=True, exist_ok=True)
    weight_map, files, total = {}, [], 0
    for k, stacked in enumerate(buckets):
        bucket = split_expert_weights(stacked)
        name = f"model-{k + 1:05d}.safetensors"
        save_file(bucket, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(bucket, name))
        total += sum(t.numel() * t.element_size() for t in bucket.values())
        files.append(name)
    if files:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return files


# --------------------------------------------------------------------------- sharded checkpoints
def _train_state(learner) -> nn.Module:
    """One module over everything the optimizer steps (policy, value head): DCP's state-dict helpers
    map optimizer state by the parameter names of one module."""
    parts = {"policy": learner.policy}
    if learner.value_head is not None:
        parts["value_head"] = learner.value_head
    return nn.ModuleDict(parts)


def save_sharded(learner, path: str | Path) -> None:
    """A DCP checkpoint directory: model and optimizer shards (each rank writes its own), plus per rank
    the balancer, counters and RNG (``rank_<r>.pt``). Every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(_train_state(learner), learner.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    torch.save(learner.host_state(), Path(path) / f"rank_{learner.dist.rank}.pt")
    dist.barrier()


def load_sharded(learner, path: str | Path) -> None:
    """Exact resume from ``save_sharded``'s directory (the same world size; any ``learner.expert_parallel``:
    DCP reshards the expert DTensors and their AdamW moments to this group's layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank_file = Path(path) / f"rank_{learner.dist.rank}.pt"
    if not rank_file.is_file():
        raise FileNotFoundError(f"{path} has no {rank_file.name}: it was saved by a learner group of another "
                                "world size (learner.num_workers) or is not a sharded learner checkpoint")  # fmt: skip
    module = _train_state(learner)
    model_sd, optim_sd = get_state_dict(module, learner.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, learner.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    learner.load_host_state(torch.load(rank_file, weights_only=False))
