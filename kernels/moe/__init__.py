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

__all__ = ["RouteLayout", "grouped_mm", "grouped_mm_alignment", "grouped_mm_backend", "permute", "route_layout",
           "unpermute"]  # fmt: skip


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


def route_layout(experts_TK: torch.Tensor, num_experts: int, align: int = 1) -> RouteLayout:
    """Sort the slots by expert (stable: equal experts keep token order), groups padded to ``align``.

    The buffer has a static size, S + num_experts * (align - 1) rows (S = T * k), so nothing
    depends on the loads on the host; unused tail rows read the zero row and are never gathered.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
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
    return RouteLayout(src_row_P, row_of_slot_S, ends_E.to(torch.int32), T, k)


def permute(z_TZ: torch.Tensor, layout: RouteLayout) -> torch.Tensor:
    """[T, Z] -> [P, Z]: each buffer row is its token's input (padding rows: zeros)."""
    z_T1Z = torch.cat([z_TZ, z_TZ.new_zeros(1, z_TZ.shape[1])])
    return z_T1Z.index_select(0, layout.src_row_P)


def unpermute(y_PN: torch.Tensor, layout: RouteLayout) -> torch.Tensor:
    """[P, N] -> [T, k, N] in (token, slot) order (a gather: each row is read at most once)."""
    return y_PN.index_select(0, layout.row_of_slot_S).view(layout.tokens, layout.top_k, -1)


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
