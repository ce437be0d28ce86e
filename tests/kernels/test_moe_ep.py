"""kernels.moe.ep: an MoE layer with its experts split over 2 gloo ranks equals the unsharded layer.

Two real processes (torch.multiprocessing.spawn, gloo over loopback) each run a ``SparseMoE`` whose
``experts`` hold only that rank's half of the stacked weights and dispatch by all-to-all, on its own
share of the tokens (uneven: 5 and 6); the parent runs the unsharded layer on all of them and compares
outputs, routed experts, input gradients, each expert's weight gradients (on its owner) and the router's
gradient (summed over the ranks, as FSDP reduces it). Cases: free routing, replay with some rows -1
(routed freely), and a replay that sends every slot to rank 1's experts (rank 0 computes nothing, both
still send and receive). float64, so the only difference is the GEMMs' grouping (<= 1e-12 relative).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from model.config import HybridConfig
from model.moe import SparseMoE
from rl.parallel import group_store, init_distributed

E, K, T, WORLD = 8, 2, 11, 2
CASES = ("free", "replay_some_free", "skewed_to_rank1")


def _config() -> HybridConfig:
    return HybridConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_experts=E, num_experts_per_token=K,
                        moe_intermediate_size=16, num_shared_experts=1, routed_expert_hidden_size=16)  # fmt: skip


def _case(name: str):
    """(layer, x [1, T, D], replay [T, k] or None, output gradient): the same on every process."""
    torch.manual_seed(0)
    moe = SparseMoE(_config()).double().train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, 32, generator=g, dtype=torch.float64)
    gy = torch.randn(1, T, 32, generator=g, dtype=torch.float64)
    replay = None
    if name == "replay_some_free":
        replay = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        replay[[1, 4, 9]] = -1
    elif name == "skewed_to_rank1":
        replay = torch.tensor([[6, 7] if t % 2 else [7, 6] for t in range(T)])
    return moe, x, replay, gy


def _share(rank: int) -> slice:
    return slice(rank * T // WORLD, (rank + 1) * T // WORLD)


def _worker(rank: int, address: tuple[str, int], out: str) -> None:
    from kernels.moe.ep import ExpertParallel

    torch.set_num_threads(1)
    init_distributed(rank, WORLD, address, torch.device("cpu"))
    try:
        results = {}
        for name in CASES:
            moe, x, replay, gy = _case(name)
            plan = ExpertParallel(E)
            ex = moe.experts
            ex.gate_up_proj = nn.Parameter(plan.local_rows(ex.gate_up_proj.detach()).clone())
            ex.down_proj = nn.Parameter(plan.local_rows(ex.down_proj.detach()).clone())
            ex.dispatch = plan
            x_mine = x[:, _share(rank)].clone().requires_grad_()
            y, used = moe(x_mine, None if replay is None else replay[_share(rank)])
            y.backward(gy[:, _share(rank)])
            results[name] = {"y": y.detach(), "used": used, "dx": x_mine.grad, "gate_up": ex.gate_up_proj.grad,
                             "down": ex.down_proj.grad, "router": moe.gate.weight.grad,
                             "latent_down": moe.routed_expert_down_proj.weight.grad}  # fmt: skip
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    store, address = group_store()  # the spawned ranks join it as clients
    mp.spawn(_worker, args=(address, str(out)), nprocs=WORLD, join=True)
    del store
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _close(name, got, want):
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_layer_equals_unsharded(sharded, case):
    moe, x, replay, gy = _case(case)
    x = x.clone().requires_grad_()
    y, used = moe(x, replay)
    y.backward(gy)
    parts = [r[case] for r in sharded]
    assert torch.equal(torch.cat([p["used"] for p in parts]), used)
    if replay is not None:  # replayed rows kept, -1 rows routed by the router
        assert torch.equal(used[replay >= 0], replay[replay >= 0])
    _close("y", torch.cat([p["y"] for p in parts], 1), y.detach())
    _close("dx", torch.cat([p["dx"] for p in parts], 1), x.grad)
    ex = moe.experts
    _close("gate_up_proj.grad", torch.cat([p["gate_up"] for p in parts]), ex.gate_up_proj.grad)
    _close("down_proj.grad", torch.cat([p["down"] for p in parts]), ex.down_proj.grad)
    _close("router grad", sum(p["router"] for p in parts), moe.gate.weight.grad)
    _close("latent down grad", sum(p["latent_down"] for p in parts), moe.routed_expert_down_proj.weight.grad)
    if case == "skewed_to_rank1":  # rank 0's experts got no token: zero gradients, not missing ones
        assert parts[0]["gate_up"] is not None and float(parts[0]["gate_up"].abs().max()) == 0.0
        assert float(parts[1]["gate_up"][2:].abs().max()) > 0.0  # experts 6, 7 (rows 2, 3 of rank 1)
