"""MoE expert compute without a Python loop over experts: route layout, permute, grouped GEMM.

The token-expert pairs (slots) of a [T, k] routing are sorted by expert into a row buffer of P
rows in which expert e owns rows ``offs[e-1]:offs[e]`` (each group padded to ``align`` rows, the
padding rows read a zero input), the experts run as grouped matrix products over that buffer,
and the results are gathered back to (token, slot) order. Everything is computed on the device
from the routing itself: no host sync, whatever the expert loads.

    layout = route_layout(experts_TK, num_experts, align)   # RouteLayout: indices and offsets
    x_PZ   = permute(z_TZ, layout)                          # [P, Z]
    y_PN   = grouped_mm(x_PZ, w_ENZ, layout.offs_E)         # y[rows of e] = x[rows of e] @ w[e]^T
    y_TKN  = unpermute(y_PN, layout)                        # [T, k, N], slot order
    y_TN   = combine(y_PN, layout, weights_TK)              # sum_j w_tj y_TjN in fp32, one autograd node

The routed experts' training path keeps less for backward by fusing the stages around the two GEMMs
into two autograd nodes (``GroupedExperts._grouped`` in ``model.moe``):

    gu_PI2 = permute_grouped_mm(z_TZ, layout, w_gu)                  # keeps z [T, Z], not x [P, Z]
    y_TN   = glu_grouped_mm_combine(gu_PI2, layout, w_down, w_TK, glu)  # keeps gate/up only (glu: GluActivation)

The first gathers the k-times larger permuted rows again in backward (for the weight gradient); the
second recomputes the activation h = glu(g, u) in backward (an element-wise kernel) and never keeps the
down projection's rows (the routing weights' gradient is <h, dy_rows W_down>, from the same product that
gives dh). Per MoE layer that drops x [P, Z], h [P, I] and the gathered y [T, k, Z] (gpu_1b at 16K tokens:
305 MiB a layer, 4.5 GiB over 15 layers); the backward does two more memory-bound passes (the gather and
the activation), no extra GEMM. ``grouped_mm_dx`` / ``grouped_mm_dw`` are the grouped product's two
gradient products, per backend, that these nodes call.

``grouped_mm`` takes weights in nn.Linear layout [G, N, K] and dispatches to PyTorch's grouped
matrix product (``torch._grouped_mm``) where it has a kernel for the device and dtype: CUDA with
bf16 on sm90+ (the CUTLASS kernel; torch's CUDA fallback for other dtypes copies the offsets to
the host and loops, which is what this module avoids), and CPU in fp32/bf16/fp16 from torch 2.9
(16-byte rows). Other CUDA cases (fp32, fp16, older GPUs, unaligned shapes) take the Triton kernel
in ``triton.py``; the rest (float64, unaligned CPU shapes) the loop in ``naive.py``.
``align = grouped_mm_alignment(...)`` pads each group to 16 bytes of rows on CUDA (torchtitan
pads likewise for the weight-gradient product, whose contraction runs over a group's rows).
``LONGHORIZON_GROUPED_MM`` (read at import; ``GROUPED_MM_BACKENDS``) names a backend instead of that
choice, to compare them (bench/moe_compile.py, bench/rollout_throughput.py): "triton" runs the Triton
kernel on CUDA bf16 too, "torch" the CUTLASS kernel for every product. Under "auto" the MoE nodes' forward
product on CUDA picks by rows (``triton.grouped_mm_forward``): a decode step's few rows a group run on a
one-launch Triton kernel, since the CUTLASS kernel read a decode step's expert weights at about 40% of the
H200's bandwidth; larger products (prefill chunks, learner micro-batches) stay on CUTLASS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.moe.naive import grouped_mm_naive, grouped_mm_naive_dw

if TYPE_CHECKING:
    from kernels.glu import GluActivation

__all__ = ["GROUPED_MM_BACKENDS", "RouteLayout", "combine", "combine_reference", "glu_grouped_mm_combine", "grouped_mm",
           "grouped_mm_alignment", "grouped_mm_backend", "grouped_mm_combine", "grouped_mm_dw", "grouped_mm_dx",
           "permute", "permute_grouped_mm", "permute_reference", "route_layout", "route_tensors", "unpermute"]  # fmt: skip


@dataclass
class RouteLayout:
    """Where every (token, slot) pair of a routing sits in the expert-sorted row buffer.

    src_row_P: token feeding each buffer row (T = the appended zero row: padding and tail rows).
    row_of_slot_S: buffer row of each flat slot t * k + j.
    offs_E: int32 cumulative group ends (what grouped_mm takes); rows past offs_E[-1] are unused.
    """

    src_row_P: torch.Tensor
    row_of_slot_S: torch.Tensor
    offs_E: torch.Tensor
    tokens: int
    top_k: int

    @property
    def rows(self) -> int:
        return self.src_row_P.numel()


def route_layout(
    experts_TK: torch.Tensor, num_experts: int, align: int = 1, build=None, counting_max: int | None = None
) -> RouteLayout:
    """Sort the slots by expert (stable: equal experts keep token order), groups padded to ``align``.

    The buffer has a static size, S + num_experts * (align - 1) rows (S = T * k), so nothing
    depends on the loads on the host; unused tail rows read the zero row and are never gathered.
    ``build``: what computes the index tensors, ``route_tensors`` or a compiled version of it
    (``model.compile``: about 25 small integer ops in one or two kernels). ``counting_max``: route_tensors'
    (None: ``COUNTING_LAYOUT_MAX``).
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    T, k = experts_TK.shape
    limit = COUNTING_LAYOUT_MAX if counting_max is None else counting_max
    src_row_P, row_of_slot_S, offs_E = (build or route_tensors)(experts_TK, num_experts, align, limit)
    return RouteLayout(src_row_P, row_of_slot_S, offs_E, T, k)


# Slots x experts up to which ``route_tensors`` ranks the slots by counting (one [E, S] prefix sum) instead of
# sorting them: a decode step's few hundred slots (gpu_1b: 64 sequences x 8 = 512) took a single-block radix
# sort of 64-bit keys, 27 us a call on an H200, the third-largest kernel of the step (bench/RESULTS.md); a
# learner micro-batch (131K slots at 16K tokens) still sorts, which is the cheaper of the two there. Under
# torch.compile the choice is a guard on the token count: a graph takes one path, and a batch across the
# limit compiles the graph again. The engine raises the limit (a module's ``counting_layout_max``) over every
# step its scheduler can form, so its compiled MoE block has one path and compiles once.
COUNTING_LAYOUT_MAX = 1 << 20


def route_tensors(
    experts_TK: torch.Tensor, num_experts: int, align: int, counting_max: int = COUNTING_LAYOUT_MAX
) -> tuple[torch.Tensor, ...]:
    """(src_row_P, row_of_slot_S, offs_E) of ``route_layout``, as a function of tensors and ints only.

    Slot s of expert e goes to row start_e + rank_s, where start_e is the padded size of the experts before e
    and rank_s the number of slots of e before s (a stable sort by expert). The rank comes from
    ``_ranks_by_count`` for up to ``counting_max`` slots x experts, else ``_ranks_by_sort``: the same
    integers either way."""
    T, k = experts_TK.shape
    flat_S = experts_TK.reshape(-1).long()
    S = flat_S.numel()
    ranks = _ranks_by_count if S * num_experts <= counting_max else _ranks_by_sort
    rank_S, counts_E = ranks(flat_S, num_experts)
    padded_E = (counts_E + align - 1) // align * align
    ends_E = padded_E.cumsum(0)
    row_of_slot_S = (ends_E - padded_E)[flat_S] + rank_S
    P = S + num_experts * (align - 1)
    src_row_P = torch.full((P,), T, dtype=torch.long, device=flat_S.device)
    src_row_P.scatter_(0, row_of_slot_S, torch.arange(S, device=flat_S.device) // k)
    return src_row_P, row_of_slot_S, ends_E.to(torch.int32)


def _ranks_by_count(flat_S: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank of each slot among its expert's slots, slots per expert) from the running count of each expert
    along the slots: a one-hot [E, S] and its prefix sum, element-wise work and one scan (no sort)."""
    onehot_ES = flat_S[None, :] == torch.arange(num_experts, device=flat_S.device)[:, None]
    seen_ES = onehot_ES.long().cumsum(1)  # slots of e up to and including s
    rank_S = seen_ES.gather(0, flat_S[None, :])[0] - 1
    return rank_S, seen_ES[:, -1]


def _ranks_by_sort(flat_S: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_ranks_by_count`` by a stable sort: sorted position minus the slots of the experts before."""
    # scatter_add, not bincount: CUDA bincount reads the maximum on the host to size its output
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat_S.device).scatter_add_(
        0, flat_S, torch.ones_like(flat_S)
    )
    order_S = flat_S.argsort(stable=True)
    before_E = counts_E.cumsum(0) - counts_E
    sorted_rank_S = torch.arange(flat_S.numel(), device=flat_S.device) - before_E[flat_S[order_S]]
    return torch.empty_like(order_S).scatter_(0, order_S, sorted_rank_S), counts_E


def permute(z_TZ: torch.Tensor, layout: RouteLayout) -> torch.Tensor:
    """[T, Z] -> [P, Z]: each buffer row is its token's input (padding rows: zeros).

    Backward: a token's gradient is the sum of its k rows' gradients, gathered (``row_of_slot_S``) and
    summed over the slots in one reduction (fp32 accumulation, one rounding, deterministic) instead of
    autograd's scatter-add of index_select (bf16 atomics on CUDA, a rounding per added row)."""
    return _Permute.apply(z_TZ, layout)


def permute_reference(z_TZ: torch.Tensor, layout: RouteLayout) -> torch.Tensor:
    """``permute`` by autograd on index_select (the reference of its backward)."""
    return _with_zero_row(z_TZ).index_select(0, layout.src_row_P)


def _with_zero_row(x_TN: torch.Tensor) -> torch.Tensor:
    """[T, N] -> [T + 1, N], the last row zero: what padding and tail rows of the buffer read."""
    return torch.nn.functional.pad(x_TN, (0, 0, 0, 1))


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_TZ, layout):
        ctx.layout = layout
        return permute_reference(z_TZ, layout)  # the same gather; only the backward differs

    @staticmethod
    def backward(ctx, g_PZ):
        lay = ctx.layout
        g_TKZ = g_PZ.index_select(0, lay.row_of_slot_S).view(lay.tokens, lay.top_k, -1)
        return g_TKZ.sum(1), None


def unpermute(y_PN: torch.Tensor, layout: RouteLayout) -> torch.Tensor:
    """[P, N] -> [T, k, N] in (token, slot) order (a gather: each row is read at most once)."""
    return y_PN.index_select(0, layout.row_of_slot_S).view(layout.tokens, layout.top_k, -1)


def combine(
    y_PN: torch.Tensor, layout: RouteLayout, weights_TK: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """sum_j w_tj y[row of (t, j)]: [P, N] rows and [T, k] weights -> [T, N] in ``dtype`` (default y's).

    The weighted slot sum of the grouped MoE in fp32 as one autograd node: forward a gather, one
    mixed-dtype multiply (bf16 rows times fp32 weights give fp32, no separate upcast copy), the sum
    over the slots and the cast; it keeps the gathered rows (as many bytes as y) and the weights, not
    the fp32 [T, k, N] product. Backward: dy rows = w g (written to their rows once, an index_copy),
    dw = <y rows, g> in fp32. Same math as ``combine_reference`` (the unpermute, upcast, multiply, sum
    of autograd), so it agrees to fp32 rounding."""
    _check_weights(weights_TK, layout)
    w_TK = _f32_weights(weights_TK)
    return _Combine.apply(y_PN, layout, w_TK, dtype or y_PN.dtype)


def combine_reference(
    y_PN: torch.Tensor, layout: RouteLayout, weights_TK: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    y_TKN = unpermute(y_PN, layout)
    y32 = y_TKN if y_TKN.dtype in (torch.float32, torch.float64) else y_TKN.float()
    return (y32 * weights_TK[..., None]).sum(1).to(dtype or y_PN.dtype)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_PN, layout, weights_TK, dtype):
        y_TKN = unpermute(y_PN, layout)
        ctx.layout, ctx.rows = layout, y_PN.shape[0]
        ctx.save_for_backward(y_TKN, weights_TK)
        return (y_TKN * weights_TK[..., None]).sum(1).to(dtype)

    @staticmethod
    def backward(ctx, g_TN):
        y_TKN, w_TK = ctx.saved_tensors
        lay = ctx.layout
        g32_T1N = g_TN.to(w_TK.dtype)[:, None, :]
        dy_PN = dw_TK = None
        if ctx.needs_input_grad[0]:
            dy_SN = (g32_T1N * w_TK[..., None]).to(y_TKN.dtype).view(lay.tokens * lay.top_k, -1)
            dy_PN = y_TKN.new_zeros(ctx.rows, y_TKN.shape[-1]).index_copy_(0, lay.row_of_slot_S, dy_SN)
        if ctx.needs_input_grad[2]:
            dw_TK = (y_TKN * g32_T1N).sum(-1)
        return dy_PN, None, dw_TK, None


def _torch_grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or x.dtype != w.dtype or x.device != w.device:
        return False
    # both kernels (and their backward) want 16-byte row strides of every operand
    if not all(d % (16 // x.element_size()) == 0 for d in (x.shape[1], w.shape[1])):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _torch_at_least(2, 9)
    return False


def _torch_at_least(major: int, minor: int) -> bool:
    got = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return got >= (major, minor)


GROUPED_MM_BACKENDS = ("auto", "torch", "triton", "naive")
GROUPED_MM = os.environ.get("LONGHORIZON_GROUPED_MM", "auto") or "auto"  # "auto": grouped_mm_backend's choice


def grouped_mm_backend(x_SK: torch.Tensor, w_GNK: torch.Tensor) -> str:
    """Which implementation ``grouped_mm`` runs for these operands: "torch", "triton" or "naive"; the one
    ``GROUPED_MM`` names where it is not "auto" (a ValueError where it cannot take these operands)."""
    usable = {
        "torch": _torch_grouped_mm_ok(x_SK, w_GNK),
        "triton": x_SK.is_cuda and x_SK.dtype in (torch.float32, torch.float16, torch.bfloat16),
        "naive": True,
    }
    if GROUPED_MM != "auto":
        if GROUPED_MM not in GROUPED_MM_BACKENDS:
            raise ValueError(f"LONGHORIZON_GROUPED_MM must be one of {GROUPED_MM_BACKENDS}, got {GROUPED_MM!r}")
        if not usable[GROUPED_MM]:
            raise ValueError(f"LONGHORIZON_GROUPED_MM={GROUPED_MM} cannot run {x_SK.dtype} operands on "
                             f"{x_SK.device.type} with rows of {x_SK.shape[1]} and {w_GNK.shape[1]}")  # fmt: skip
        return GROUPED_MM
    return next(name for name in ("torch", "triton", "naive") if usable[name])


def grouped_mm_alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Rows per group a multiple of this: 16 bytes on CUDA, 1 elsewhere."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size()) if device.type == "cuda" else 1


class _GradContiguous(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch's CPU grouped-mm backward
    rejects the zero-stride gradient of a ``.sum()``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm(x_SK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """y [S, N] with y[offs[g-1]:offs[g]] = x[offs[g-1]:offs[g]] @ w[g]^T; differentiable in x and w.

    offs: int32 [G] non-decreasing group ends, offs[-1] <= S. Rows past offs[-1] are not computed
    (undefined on the torch path; zero on the Triton and loop paths): callers never read them.
    """
    if x_SK.ndim != 2 or w_GNK.ndim != 3 or x_SK.shape[1] != w_GNK.shape[2]:
        raise ValueError(
            f"grouped_mm takes x [S, K] and w [G, N, K], got {tuple(x_SK.shape)}, {tuple(w_GNK.shape)}"
        )
    if offs_G.shape != (w_GNK.shape[0],):
        raise ValueError(
            f"offs must have one end per group ({w_GNK.shape[0]}), got shape {tuple(offs_G.shape)}"
        )
    backend = grouped_mm_backend(x_SK, w_GNK)
    if backend == "torch":
        return _GradContiguous.apply(
            torch._grouped_mm(x_SK, w_GNK.transpose(-2, -1), offs=offs_G.to(torch.int32))
        )
    if backend == "triton":
        from kernels.moe.triton import grouped_mm_triton

        return grouped_mm_triton(x_SK, w_GNK, offs_G)
    return grouped_mm_naive(x_SK, w_GNK, offs_G)


def grouped_mm_dx(
    dy_SN: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, backend: str
) -> torch.Tensor:
    """The input gradient of ``grouped_mm(x, w, offs)``: dx [S, K] with dx[rows of g] = dy[rows of g] @ w[g]
    (rows past offs[-1] as ``grouped_mm`` leaves them). ``backend``: ``grouped_mm_backend(x, w)``."""
    if backend == "torch":
        return torch._grouped_mm(dy_SN, w_GNK, offs=offs_G)
    if backend == "triton":
        from kernels.moe.triton import grouped_mm_triton_dx

        return grouped_mm_triton_dx(dy_SN, w_GNK, offs_G)
    return grouped_mm_naive(dy_SN, w_GNK.transpose(1, 2), offs_G)


def grouped_mm_dw(
    dy_SN: torch.Tensor, x_SK: torch.Tensor, offs_G: torch.Tensor, backend: str
) -> torch.Tensor:
    """The weight gradient of ``grouped_mm(x, w, offs)``: dw [G, N, K] with dw[g] = dy[rows of g]^T x[rows of g]
    (an empty group gets zeros; rows past offs[-1] count nowhere)."""
    if backend == "torch":
        return torch._grouped_mm(dy_SN.t(), x_SK, offs=offs_G)
    if backend == "triton":
        from kernels.moe.triton import grouped_mm_triton_dw

        return grouped_mm_triton_dw(dy_SN, x_SK, offs_G)
    return grouped_mm_naive_dw(dy_SN, x_SK, offs_G)


def _grouped_mm_forward(
    x_SK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, backend: str
) -> torch.Tensor:
    """``grouped_mm`` without its autograd node (inside the nodes below, which make their own). On CUDA under
    the "auto" choice the torch backend's forward picks its kernel by rows (``triton.grouped_mm_forward``:
    a decode step's few rows a group on our Triton kernel); its gradient products stay torch's."""
    if backend == "torch":
        if x_SK.is_cuda and GROUPED_MM == "auto":
            from kernels.moe.triton import grouped_mm_forward

            return grouped_mm_forward(x_SK, w_GNK, offs_G)
        return torch._grouped_mm(x_SK, w_GNK.transpose(-2, -1), offs=offs_G)
    return grouped_mm_dx(x_SK, w_GNK.transpose(1, 2), offs_G, backend)


def permute_grouped_mm(z_TZ: torch.Tensor, layout: RouteLayout, w_GNZ: torch.Tensor) -> torch.Tensor:
    """``grouped_mm(permute(z, layout), w.to(z.dtype), layout.offs_E)`` [P, N] as one autograd node that
    keeps z [T, Z] instead of the k-times larger permuted rows, and gathers them again in backward for the
    weight gradient. The input gradient sums each token's k rows as ``permute``'s backward does.

    ``w`` may be the fp32 master weight: it is cast to z's dtype in forward and again in backward, so the
    cast copy is not kept in between (gpu_1b: 64 MiB a layer, for an element-wise pass over the weight);
    its gradient, computed in z's dtype, reaches w as the cast's backward would hand it on."""
    return _PermuteGroupedMM.apply(z_TZ, layout, w_GNZ)


class _PermuteGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_TZ, layout, w_GNZ):
        z_T1Z = _with_zero_row(z_TZ)  # kept: the backward's gather is then one op, as the forward's
        x_PZ = z_T1Z.index_select(0, layout.src_row_P)
        w_c = w_GNZ.to(z_TZ.dtype)
        ctx.backend = grouped_mm_backend(x_PZ, w_c)
        ctx.layout = layout
        ctx.save_for_backward(z_T1Z, w_GNZ)
        return _grouped_mm_forward(x_PZ, w_c, layout.offs_E, ctx.backend)

    @staticmethod
    def backward(ctx, dy_PN):
        z_T1Z, w_GNZ = ctx.saved_tensors
        lay, dy_PN = ctx.layout, dy_PN.contiguous()
        dz = dw = None
        if ctx.needs_input_grad[0]:
            dx_PZ = grouped_mm_dx(dy_PN, w_GNZ.to(z_T1Z.dtype), lay.offs_E, ctx.backend)
            dz = dx_PZ.index_select(0, lay.row_of_slot_S).view(lay.tokens, lay.top_k, -1).sum(1)
        if ctx.needs_input_grad[2]:
            dw = grouped_mm_dw(dy_PN, z_T1Z.index_select(0, lay.src_row_P), lay.offs_E, ctx.backend)
        return dz, None, dw


def glu_grouped_mm_combine(
    gu_PI2: torch.Tensor,
    layout: RouteLayout,
    w_GNI: torch.Tensor,
    weights_TK: torch.Tensor,
    glu: GluActivation,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``combine(grouped_mm(glu(g, u), w.to(gu.dtype), layout.offs_E), layout, weights, dtype)`` [T, N], g
    and u the two halves of the gate/up rows ``gu_PI2``, as one autograd node that keeps only gu, w and the
    weights (w cast in forward and again in backward, as in ``permute_grouped_mm``).

    ``glu`` (``kernels.glu.GluActivation``): the gated activation's values and closed-form gradient, the
    fused kernels where the model takes them. The node recomputes h = glu(g, u) in backward. No autograd runs
    inside the node, so ``torch.compile`` traces it whole (a compiled MoE block is one graph each way).
    Backward, with dy_j = w_j g the gradient of a slot's down-projected row: the unweighted rows' product
    dq = g_rows W[e] gives dw_j = <h_j, dq_j> (fp32) and dh = w_j dq_j, and dW[e] = sum_rows (w_j g)^T h_j as
    ``combine`` + ``grouped_mm`` give it. Against them only rounding differs: dh rounds the product before the
    weight, not after, and the activation's gradient is its closed form."""
    _check_weights(weights_TK, layout)
    if gu_PI2.shape[1] != 2 * w_GNI.shape[2]:
        raise ValueError(
            f"gate/up rows must be [P, 2I] for w [G, N, I], got {tuple(gu_PI2.shape)} and {tuple(w_GNI.shape)}"
        )
    w_TK = _f32_weights(weights_TK)
    if torch.is_grad_enabled() and (gu_PI2.requires_grad or w_GNI.requires_grad or w_TK.requires_grad):
        return _GluGroupedMMCombine.apply(gu_PI2, layout, w_GNI, w_TK, glu, dtype or gu_PI2.dtype)
    # no gradient wanted (the engine, no-grad logprob passes): the node's forward math without the node
    h_PI = glu.values(*gu_PI2.chunk(2, dim=-1))
    return _grouped_mm_combine(h_PI, layout, w_GNI, w_TK, dtype or gu_PI2.dtype)[0]


def grouped_mm_combine(
    h_PI: torch.Tensor, layout: RouteLayout, w_GNI: torch.Tensor, weights_TK: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """``glu_grouped_mm_combine`` from the activation rows h instead of the gate/up rows, without gradient: the
    down product and the weighted slot sum (the engine's path where one kernel gave h: ``kernels.moe.triton.
    permute_situ_engine``)."""
    _check_weights(weights_TK, layout)
    return _grouped_mm_combine(h_PI, layout, w_GNI, _f32_weights(weights_TK), dtype or h_PI.dtype)[0]


def _check_weights(weights_TK: torch.Tensor, layout: RouteLayout) -> None:
    if weights_TK.shape != (layout.tokens, layout.top_k):
        raise ValueError(
            f"weights must be [T, k] = [{layout.tokens}, {layout.top_k}], got {tuple(weights_TK.shape)}"
        )


def _f32_weights(weights_TK: torch.Tensor) -> torch.Tensor:
    return weights_TK if weights_TK.dtype in (torch.float32, torch.float64) else weights_TK.float()


def _grouped_mm_combine(h_PI, layout: RouteLayout, w_GNI, w_TK, dtype) -> tuple[torch.Tensor, str]:
    """The forward of ``glu_grouped_mm_combine`` given the activation rows h: (output, grouped GEMM backend)."""
    w_c = w_GNI.to(h_PI.dtype)
    backend = grouped_mm_backend(h_PI, w_c)
    y_PN = _grouped_mm_forward(h_PI, w_c, layout.offs_E, backend)
    return (unpermute(y_PN, layout) * w_TK[..., None]).sum(1).to(dtype), backend


def scaled_rows(x_PN: torch.Tensor, w_P1: torch.Tensor) -> torch.Tensor:
    """``scale_rows_`` into a new tensor (x kept)."""
    if torch.compiler.is_compiling() or not x_PN.is_cuda:
        return (x_PN * w_P1).to(x_PN.dtype)
    return scale_rows_(x_PN.clone(), w_P1)


def scale_rows_(x_PN: torch.Tensor, w_P1: torch.Tensor) -> torch.Tensor:
    """x *= w ([P, N] rows times [P, 1] fp32 weights), fp32 math rounded once to x's dtype: the Triton kernel
    in place on CUDA (``triton.scale_rows_triton_``; PyTorch's broadcast mixed-dtype multiply is not
    vectorised: 6.5 ms of an H200 learner step at 16K tokens), ``mul_`` (the reference) elsewhere. Inside a
    compiled graph the same math as plain ops into a new tensor, which inductor fuses into one kernel."""
    if torch.compiler.is_compiling():
        return (x_PN * w_P1).to(x_PN.dtype)
    if x_PN.is_cuda and x_PN.ndim == 2 and x_PN.stride(-1) == 1:
        from kernels.moe.triton import scale_rows_triton_

        return scale_rows_triton_(x_PN, w_P1.reshape(-1))
    return x_PN.mul_(w_P1)


class _GluGroupedMMCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu_PI2, layout, w_GNI, w_TK, glu, dtype):
        h_PI = glu.values(*gu_PI2.chunk(2, dim=-1))
        y_TN, ctx.backend = _grouped_mm_combine(h_PI, layout, w_GNI, w_TK, dtype)
        ctx.layout, ctx.glu = layout, glu
        ctx.save_for_backward(gu_PI2, w_GNI, w_TK)
        return y_TN

    @staticmethod
    def backward(ctx, g_TN):
        gu_PI2, w_GNI, w_TK = ctx.saved_tensors
        lay, glu = ctx.layout, ctx.glu
        g_PI, u_PI = gu_PI2.chunk(2, dim=-1)
        dt = gu_PI2.dtype
        w_GNI = w_GNI.to(dt)
        # each buffer row's token gradient (padding and tail rows read the zero row) and slot weight
        g_PN = _with_zero_row(g_TN).index_select(0, lay.src_row_P)
        w_P = w_TK.new_zeros(lay.rows).index_copy(0, lay.row_of_slot_S, w_TK.reshape(-1))[:, None]
        dq_PI = grouped_mm_dx(g_PN.to(dt), w_GNI, lay.offs_E, ctx.backend)
        dgu = None
        if ctx.needs_input_grad[0]:  # h recomputed with the activation's gradient at dh = w_j dq_j
            h_PI, dg_PI, du_PI = glu.values_and_grad(g_PI, u_PI, scaled_rows(dq_PI, w_P))
            dgu = torch.cat((dg_PI, du_PI), dim=-1)
            del dg_PI, du_PI
        else:
            h_PI = glu.values(g_PI, u_PI)
        dw_TK = dW = None
        if ctx.needs_input_grad[3]:  # fp32 sums of the products (rounded to h's dtype, as y's entries were)
            hq_P = (h_PI * dq_PI).sum(-1, dtype=w_TK.dtype)
            dw_TK = hq_P.index_select(0, lay.row_of_slot_S).view(lay.tokens, lay.top_k)
        del dq_PI
        if ctx.needs_input_grad[2]:  # rows w_j g rounded once, as combine's backward gives them
            dy_PN = scale_rows_(g_PN, w_P) if g_PN.dtype == dt else (g_PN * w_P).to(dt)
            dW = grouped_mm_dw(dy_PN, h_PI, lay.offs_E, ctx.backend)
        return dgu, None, dW, dw_TK, None, None
