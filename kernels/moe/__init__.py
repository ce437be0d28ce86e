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

``grouped_mm`` takes weights in nn.Linear layout [G, N, K] and dispatches to PyTorch's grouped
matrix product (``torch._grouped_mm``) where it has a kernel for the device and dtype: CUDA with
bf16 on sm90+ (the CUTLASS kernel; torch's CUDA fallback for other dtypes copies the offsets to
the host and loops, which is what this module avoids), and CPU in fp32/bf16/fp16 from torch 2.9
(16-byte rows). Other CUDA cases (fp32, fp16, older GPUs, unaligned shapes) take the Triton kernel
in ``triton.py``; the rest (float64, unaligned CPU shapes) the loop in ``naive.py``.
``align = grouped_mm_alignment(...)`` pads each group to 16 bytes of rows on CUDA (torchtitan
pads likewise for the weight-gradient product, whose contraction runs over a group's rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.moe.naive import grouped_mm_naive

__all__ = ["RouteLayout", "combine", "combine_reference", "grouped_mm", "grouped_mm_alignment", "grouped_mm_backend",
           "permute", "permute_reference", "route_layout", "route_tensors", "unpermute"]  # fmt: skip


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


def route_layout(experts_TK: torch.Tensor, num_experts: int, align: int = 1, build=None) -> RouteLayout:
    """Sort the slots by expert (stable: equal experts keep token order), groups padded to ``align``.

    The buffer has a static size, S + num_experts * (align - 1) rows (S = T * k), so nothing
    depends on the loads on the host; unused tail rows read the zero row and are never gathered.
    ``build``: what computes the index tensors, ``route_tensors`` or a compiled version of it
    (``model.compile``: about 25 small integer ops in one or two kernels).
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    T, k = experts_TK.shape
    src_row_P, row_of_slot_S, offs_E = (build or route_tensors)(experts_TK, num_experts, align)
    return RouteLayout(src_row_P, row_of_slot_S, offs_E, T, k)


def route_tensors(experts_TK: torch.Tensor, num_experts: int, align: int) -> tuple[torch.Tensor, ...]:
    """(src_row_P, row_of_slot_S, offs_E) of ``route_layout``, as a function of tensors and ints only."""
    T, k = experts_TK.shape
    dev = experts_TK.device
    flat_S = experts_TK.reshape(-1).long()
    S = flat_S.numel()
    # scatter_add, not bincount: CUDA bincount reads the maximum on the host to size its output
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat_S, torch.ones_like(flat_S)
    )
    padded_E = (counts_E + align - 1) // align * align
    ends_E = padded_E.cumsum(0)
    order_S = flat_S.argsort(stable=True)
    expert_sorted_S = flat_S[order_S]
    rank_S = torch.arange(S, device=dev) - (counts_E.cumsum(0) - counts_E)[expert_sorted_S]
    row_sorted_S = (ends_E - padded_E)[expert_sorted_S] + rank_S
    row_of_slot_S = torch.empty_like(order_S).scatter_(0, order_S, row_sorted_S)
    P = S + num_experts * (align - 1)
    src_row_P = torch.full((P,), T, dtype=torch.long, device=dev)
    src_row_P.scatter_(0, row_of_slot_S, torch.arange(S, device=dev) // k)
    return src_row_P, row_of_slot_S, ends_E.to(torch.int32)


def permute(z_TZ: torch.Tensor, layout: RouteLayout) -> torch.Tensor:
    """[T, Z] -> [P, Z]: each buffer row is its token's input (padding rows: zeros).

    Backward: a token's gradient is the sum of its k rows' gradients, gathered (``row_of_slot_S``) and
    summed over the slots in one reduction (fp32 accumulation, one rounding, deterministic) instead of
    autograd's scatter-add of index_select (bf16 atomics on CUDA, a rounding per added row)."""
    return _Permute.apply(z_TZ, layout)


def permute_reference(z_TZ: torch.Tensor, layout: RouteLayout) -> torch.Tensor:
    """``permute`` by autograd on index_select (the reference of its backward)."""
    z_T1Z = torch.cat([z_TZ, z_TZ.new_zeros(1, z_TZ.shape[1])])
    return z_T1Z.index_select(0, layout.src_row_P)


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
    if weights_TK.shape != (layout.tokens, layout.top_k):
        raise ValueError(
            f"weights must be [T, k] = [{layout.tokens}, {layout.top_k}], got {tuple(weights_TK.shape)}"
        )
    w_TK = weights_TK if weights_TK.dtype in (torch.float32, torch.float64) else weights_TK.float()
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


def grouped_mm_backend(x_SK: torch.Tensor, w_GNK: torch.Tensor) -> str:
    """Which implementation ``grouped_mm`` runs for these operands: "torch", "triton" or "naive"."""
    if _torch_grouped_mm_ok(x_SK, w_GNK):
        return "torch"
    if x_SK.is_cuda and x_SK.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return "triton"
    return "naive"


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
