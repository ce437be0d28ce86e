"""Expert parallelism: one MoE layer's experts split over the ranks of a group, tokens sent by all-to-all.

Rank r of an expert-parallel group of size ep holds experts [r * E/ep, (r+1) * E/ep) of the layer (rows of
the two stacked weights of ``model.moe.GroupedExperts``). Every rank routes its own tokens on the full E
(the router, routing replay and the balancing bias are untouched: the dispatch starts from the router's
``RouterOutput``), then

    lay   = route_layout(experts_TK, E)            # slots sorted by expert = grouped by owning rank
    x_SZ  = permute(z_TZ, lay)                     # [S = T k, Z] the slots' inputs, in that order
    x_RZ  = all_to_all(x_SZ)                       # the slots of my experts, from every rank (source-major)
    y_RZ  = my experts on x_RZ                     # kernels.moe: route layout, permute, grouped_mm, unpermute
    y_SZ  = all_to_all(y_RZ)                       # back to the sending rank, in its sorted slot order
    y_TZ  = combine(y_SZ, lay, weights_TK)         # sum_j w_tj y_tj in fp32, (token, slot) order

``combine`` is the weighted sum ``GroupedExperts._grouped`` ends with (there fused with the activation and
the down GEMM, ``kernels.moe.glu_grouped_mm_combine``), on a layout with the same ``row_of_slot_S`` meaning,
so the sum runs over the same products in the same order: the layer equals the unsharded one up to the
GEMMs' rounding (their rows are grouped differently). The per-expert counts are exchanged first
(one small all-to-all) and read on the host once per forward: ``all_to_all_single`` takes its split sizes
as Python ints. Gradients: the all-to-all's backward is the reverse all-to-all (``_AllToAll``), so the
input, routing-weight and (local) expert-weight gradients are those of the unsharded layer; an expert
weight's gradient is complete on its owner (every slot routed to it came through this rank), so it needs
no reduction over the expert-parallel group.

gloo implements ``all_to_all_single`` (``alltoall_base``, uneven splits) for CPU tensors, nccl for CUDA
ones: no fallback is needed on either (tests/kernels/test_moe_ep.py runs it over gloo).

The dispatch is attached from outside (``GroupedExperts.dispatch``, set by rl/parallel.py), like FSDP:
the model stays single-device code. Weights may be DTensors (sharded on dim 0 over the ep mesh, as the
learner holds them): the dispatch computes on their local shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.moe import combine, grouped_mm_alignment, permute, route_layout


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; backward: the reverse all-to-all of the gradient rows."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = torch.zeros(sum(out_splits), *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable all-to-all of rows: ``in_splits[r]`` rows of ``x`` go to rank r, ``out_splits[r]``
    rows come from it (in rank order)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def _local(w: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiable: its gradient goes back as a DTensor of the same layout)."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class ExpertParallel:
    """The dispatch of one MoE layer over an expert-parallel ``group`` (module docstring).

    Called as ``GroupedExperts.dispatch(experts, z_TZ, route, w_gu, w_down)`` with this rank's expert
    weights ([E/ep, 2I, Z] and [E/ep, Z, I], plain tensors or DTensors sharded on dim 0)."""

    def __init__(self, num_experts: int, group=None) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs num_experts divisible by it, got {num_experts}"
            )
        self.num_experts, self.num_local = num_experts, num_experts // self.size
        self.first = self.rank * self.num_local

    def local_rows(self, full_E: torch.Tensor) -> torch.Tensor:
        """This rank's experts' rows of a stacked [E, ...] weight."""
        return full_E[self.first : self.first + self.num_local]

    def __call__(
        self, experts, z_TZ: torch.Tensor, route, w_gu: torch.Tensor, w_down: torch.Tensor
    ) -> torch.Tensor:
        from model.layers import compute_dtype

        w_gu, w_down = _local(w_gu), _local(w_down)
        if w_gu.shape[0] != self.num_local or w_down.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} holds {self.num_local} experts, got weights of "
                             f"{w_gu.shape[0]} and {w_down.shape[0]}")  # fmt: skip
        dt = compute_dtype(z_TZ)
        lay = route_layout(route.experts_TK, self.num_experts, 1, experts.route_fn)  # S rows, no padding
        counts_E = torch.diff(lay.offs_E.long(), prepend=lay.offs_E.new_zeros(1).long())
        recv_E = _all_to_all(counts_E, [self.num_local] * self.size, [self.num_local] * self.size, self.group)
        host = torch.stack([counts_E, recv_E]).cpu()  # the one host sync: split sizes are Python ints
        send = host[0].view(self.size, self.num_local).sum(1).tolist()
        recv_RE = host[1].view(self.size, self.num_local)  # [source rank, my expert]
        recv = recv_RE.sum(1).tolist()
        x_RZ = all_to_all(permute(z_TZ.to(dt), lay), recv, send, self.group)
        y_RZ = self._local_experts(experts, x_RZ, recv_RE, w_gu.to(dt), w_down.to(dt))
        y_SZ = all_to_all(y_RZ, send, recv, self.group)
        return combine(y_SZ, lay, route.weights_TK, z_TZ.dtype)

    def _local_experts(self, experts, x_RZ, recv_RE, w_gu, w_down) -> torch.Tensor:
        """This rank's experts on the rows it received (source-major, expert-sorted within a source),
        through the grouped GEMMs of ``GroupedExperts.grouped_glu``; results in the received order.

        No rows (all slots went elsewhere): zeros that still depend on the rows and the weights, so that
        the backward runs the reverse all-to-all here too (the other ranks wait for it) and the weights
        get zero gradients, as the unsharded layer gives an unused expert (the grouped kernels' empty
        products are not part of the graph)."""
        if x_RZ.shape[0] == 0:
            return x_RZ.new_zeros(0, w_down.shape[1]) + 0 * (x_RZ.sum() + w_gu.sum() + w_down.sum())
        local_R = torch.repeat_interleave(torch.arange(self.num_local).repeat(self.size), recv_RE.reshape(-1))
        align = grouped_mm_alignment(x_RZ.device, x_RZ.dtype)
        lay = route_layout(local_R.to(x_RZ.device)[:, None], self.num_local, align, experts.route_fn)
        y_PZ = experts.grouped_glu(permute(x_RZ, lay), lay.offs_E, w_gu, w_down)
        return y_PZ.index_select(0, lay.row_of_slot_S)  # ``unpermute`` at k = 1 (also for R = 0 rows)
