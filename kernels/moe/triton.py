"""Triton grouped matrix product for the cases PyTorch's has no device kernel for (fp32 / fp16 on CUDA,
GPUs before sm90): y[rows of g] = x[rows of g] @ w[g]^T with the group ends ``offs`` read on the device.

Forward (and dx, the same kernel on w transposed): one program per (row tile, column tile); the row
tiles of every group are laid out on the device from ``offs`` (``_tile_schedule``: a static upper
bound of cdiv(S, BM) + G tiles, spare programs exit), so the launch needs no host sync. dw[g] =
dy[rows of g]^T @ x[rows of g]: one program per (group, column tile, k tile) looping over the group's
rows. fp32 inputs multiply in IEEE fp32 (``input_precision="ieee"``), half inputs on the tensor cores
with fp32 accumulation. Tested under TRITON_INTERPRET=1 against ``naive.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.glu.jit import situ
from kernels.op_names import op_name

BM, BN, BK = 64, 64, 32
# ``grouped_mm_forward``'s kernel for few rows a group (a decode step's: gpu_1b's 64 sequences put ~4-11 rows on
# each of 128 experts): one program per (group, column tile), the group's rows in 16-row tiles
SMALL_BM, SMALL_BN, SMALL_BK = 16, 64, 64


@dataclass(frozen=True)
class SmallTiles:
    """A launch of ``_gmm_groups``: rows, columns and k a tile, warps a program, software-pipeline stages."""

    bm: int = SMALL_BM
    bn: int = SMALL_BN
    bk: int = SMALL_BK
    warps: int = 4
    stages: int = 3


# ``grouped_mm_small``'s launch by rows, from bench/grouped_mm_decode.py --sweep on an H200 (gpu_1b's two expert
# products, 2026-12-07): up to ~16 sequences (960 rows) the default; 64-128 sequences (1,408-1,920 rows) two
# pipeline stages, 19.2 / 10.3 us against 22.4 / 11.3 (gate/up / down at 64); 256 (2,944 rows) 32-row tiles,
# 21.4 / 12.5 against 29.3 / 15.0. Each entry: (rows below which it applies, launch); the last applies above.
SMALL_TILES_BY_ROWS = ((1024, SmallTiles()), (2560, SmallTiles(stages=2)), (None, SmallTiles(bm=32)))


def small_tiles(rows: int) -> SmallTiles:
    """The launch ``grouped_mm_small`` takes for ``rows`` rows (``SMALL_TILES_BY_ROWS``)."""
    return next(t for below, t in SMALL_TILES_BY_ROWS if below is None or rows < below)


# rows up to which ``grouped_mm_forward`` runs that kernel: a decode step of up to 512 sequences at top-8 (with
# the groups' padding); larger products (prefill chunks, learner micro-batches) take torch's CUTLASS kernel
SMALL_ROWS_MAX = 4096


def _tile_schedule(offs_G: torch.Tensor, block_m: int, max_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row tile: its group (G = spare) and first row, from the group ends, on the device."""
    offs = offs_G.long()
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    tiles = (offs - starts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    t = torch.arange(max_tiles, device=offs.device)
    group = torch.searchsorted(tile_end, t, right=True)
    g = group.clamp(max=offs.numel() - 1)
    first_row = starts[g] + (t - (tile_end[g] - tiles[g])) * block_m
    return group.to(torch.int32), first_row.to(torch.int32)


@triton.jit
def _tile(x_ptr, w_ptr, y_ptr, g, r0, row_end, col0, N, K, sxm, sxk, swg, swn, swk, sym, syn,
          PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """One output tile of group g: y[rows, cols] = x[rows] @ w[g][cols]^T for the rows r0 .. r0 + BM below row_end
    and the columns col0 .. col0 + BN below N, accumulated in fp32."""
    rows = r0 + tl.arange(0, BM)
    cols = col0 + tl.arange(0, BN)
    rm, cm = rows < row_end, cols < N
    acc = tl.full([BM, BN], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxm + ks[None, :] * sxk,
                    mask=rm[:, None] & km[None, :], other=0.0)  # fmt: skip
        b = tl.load(w_ptr + g.to(tl.int64) * swg + cols[None, :] * swn + ks[:, None] * swk,
                    mask=km[:, None] & cm[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(a, b, input_precision=PREC)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :] * syn,
             acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])  # fmt: skip


@triton.jit
def _gmm_rows(x_ptr, w_ptr, y_ptr, offs_ptr, tile_group_ptr, tile_row_ptr, N, K, G,
              sxm, sxk, swg, swn, swk, sym, syn,
              PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    tile = tl.program_id(0)
    g = tl.load(tile_group_ptr + tile)
    if g < G:
        _tile(x_ptr, w_ptr, y_ptr, g, tl.load(tile_row_ptr + tile), tl.load(offs_ptr + g), tl.program_id(1) * BN,
              N, K, sxm, sxk, swg, swn, swk, sym, syn, PREC, BM, BN, BK)  # fmt: skip


@triton.jit
def _gmm_dw(dy_ptr, x_ptr, dw_ptr, offs_ptr, N, K, sdm, sdn, sxm, sxk,
            PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    g = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.program_id(2) * BK + tl.arange(0, BK)
    cm, km = cols < N, ks < K
    row_end = tl.load(offs_ptr + g)
    row_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    acc = tl.full([BN, BK], 0.0, dtype=tl.float32)
    for r0 in range(row_start, row_end, BM):
        rows = r0 + tl.arange(0, BM)
        rm = rows < row_end
        d = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * sdm + cols[None, :] * sdn,
                    mask=rm[:, None] & cm[None, :], other=0.0)  # fmt: skip
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxm + ks[None, :] * sxk,
                    mask=rm[:, None] & km[None, :], other=0.0)  # fmt: skip
        acc += tl.dot(tl.trans(d), a, input_precision=PREC)
    out = dw_ptr + g.to(tl.int64) * N * K + cols[:, None] * K + ks[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=cm[:, None] & km[None, :])


@triton.jit
def _gmm_groups(x_ptr, w_ptr, y_ptr, offs_ptr, N, K, sxm, sxk, swg, swn, swk, sym, syn,
                PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """y[rows of g, cols] = x[rows of g] @ w[g][cols]^T for program (g, column tile): no tile schedule to build
    (an empty group's program exits at once, having read no weight); its rows in BM-row tiles."""
    g = tl.program_id(0)
    row_end = tl.load(offs_ptr + g)
    row_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    for r0 in range(row_start, row_end, BM):
        _tile(x_ptr, w_ptr, y_ptr, g, r0, row_end, tl.program_id(1) * BN, N, K, sxm, sxk, swg, swn, swk, sym, syn,
              PREC, BM, BN, BK)  # fmt: skip


def grouped_mm_small(
    x_SK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, tiles: SmallTiles | None = None
) -> torch.Tensor:
    """y [S, N] with y[rows of g] = x[rows of g] @ w[g]^T, forward only, in one launch (``_gmm_groups``): the
    product for few rows a group. offs: int32 [G] group ends; rows past offs[-1] are left unwritten (callers
    never read them, as with torch's kernel). ``tiles``: the launch (default ``small_tiles(S)``;
    bench/grouped_mm_decode.py ``--sweep`` times others)."""
    S, K = x_SK.shape
    G, N, _ = w_GNK.shape
    t = tiles or small_tiles(S)
    y = torch.empty(S, N, device=x_SK.device, dtype=x_SK.dtype)
    if S and N and G:
        _gmm_groups[(G, triton.cdiv(N, t.bn))](
            x_SK, w_GNK, y, offs_G, N, K, x_SK.stride(0), x_SK.stride(1), *w_GNK.stride(), y.stride(0), y.stride(1),
            PREC=_prec(x_SK.dtype), BM=t.bm, BN=t.bn, BK=t.bk, num_warps=t.warps, num_stages=t.stages,
        )  # fmt: skip
    return y


@torch.library.custom_op(op_name("grouped_mm_forward"), mutates_args=())
def grouped_mm_forward(x_SK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """The forward product of ``kernels.moe``'s "torch" backend on CUDA under the "auto" choice, by rows: up to
    ``SMALL_ROWS_MAX`` rows ``grouped_mm_small``, which read a decode step's expert weights faster than torch's
    CUTLASS kernel (bench/RESULTS.md, "Rollout throughput"), else that kernel. A custom op, so the rows are looked
    at when it runs: in a compiled MoE block a rule on the traced row count would be a guard, and a step across
    it a second compile of the block. Rows past offs[-1] are undefined, as with torch's kernel."""
    if x_SK.shape[0] <= SMALL_ROWS_MAX:
        return grouped_mm_small(x_SK, w_GNK, offs_G.to(torch.int32).contiguous())
    return torch._grouped_mm(x_SK, w_GNK.transpose(-2, -1), offs=offs_G.to(torch.int32))


@grouped_mm_forward.register_fake
def _(x_SK, w_GNK, offs_G):
    return x_SK.new_empty(x_SK.shape[0], w_GNK.shape[1])


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for half inputs


def _rows(x_SK: torch.Tensor, w, w_strides, N: int, offs_G: torch.Tensor) -> torch.Tensor:
    """y [S, N] = per group x @ W^T where W[g][n, k] is at w + g*s0 + n*s1 + k*s2."""
    S, K = x_SK.shape
    G = offs_G.numel()
    y = torch.zeros(S, N, device=x_SK.device, dtype=x_SK.dtype)  # rows past offs[-1] stay zero
    max_tiles = triton.cdiv(S, BM) + G
    group, first_row = _tile_schedule(offs_G, BM, max_tiles)
    grid = (max_tiles, triton.cdiv(N, BN))
    _gmm_rows[grid](x_SK, w, y, offs_G, group, first_row, N, K, G, x_SK.stride(0), x_SK.stride(1),
                    *w_strides, y.stride(0), y.stride(1), PREC=_prec(x_SK.dtype), BM=BM, BN=BN, BK=BK)  # fmt: skip
    return y


def grouped_mm_triton_dx(dy_SN: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """dx [S, K] of y = x @ w[g]^T per group: dy[rows of g] @ w[g] (the forward kernel on w transposed)."""
    s0, s1, s2 = w_GNK.stride()
    return _rows(dy_SN, w_GNK, (s0, s2, s1), w_GNK.shape[2], offs_G)


def grouped_mm_triton_dw(dy_SN: torch.Tensor, x_SK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """dw [G, N, K] of y = x @ w[g]^T per group: dy[rows of g]^T @ x[rows of g] (rows past offs[-1] ignored)."""
    (G,), N, K = offs_G.shape, dy_SN.shape[1], x_SK.shape[1]
    dw = torch.empty(G, N, K, device=x_SK.device, dtype=x_SK.dtype)
    grid = (G, triton.cdiv(N, BN), triton.cdiv(K, BK))
    _gmm_dw[grid](dy_SN, x_SK, dw, offs_G, N, K, dy_SN.stride(0), dy_SN.stride(1), x_SK.stride(0),
                  x_SK.stride(1), PREC=_prec(x_SK.dtype), BM=BM, BN=BN, BK=BK)  # fmt: skip
    return dw


class GroupedMMTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SK, w_GNK, offs_G):
        ctx.save_for_backward(x_SK, w_GNK, offs_G)
        return _rows(x_SK, w_GNK, w_GNK.stride(), w_GNK.shape[1], offs_G)

    @staticmethod
    def backward(ctx, dy_SN):
        x_SK, w_GNK, offs_G = ctx.saved_tensors
        dy_SN = dy_SN.contiguous()
        dx = grouped_mm_triton_dx(dy_SN, w_GNK, offs_G) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_triton_dw(dy_SN, x_SK, offs_G) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm_triton(x_SK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.moe.grouped_mm`` (rows past offs[-1] are zero here)."""
    if x_SK.dtype != w_GNK.dtype:
        raise ValueError(f"x and w must share a dtype, got {x_SK.dtype} and {w_GNK.dtype}")
    return GroupedMMTriton.apply(x_SK, w_GNK, offs_G.to(torch.int32).contiguous())


@triton.jit
def _scale_rows(x_ptr, w_ptr, R, N: tl.constexpr, sx: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rm = rows < R
    w = tl.load(w_ptr + rows, mask=rm, other=0.0).to(tl.float32)
    m = rm[:, None] & (cols < N)[None, :]
    ptrs = x_ptr + rows[:, None] * sx + cols[None, :]
    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    tl.store(ptrs, (x * w[:, None]).to(x_ptr.dtype.element_ty), mask=m)


def scale_rows_triton_(x_PN: torch.Tensor, w_P: torch.Tensor) -> torch.Tensor:
    """x[p, :] *= w[p] in place, in fp32 and rounded once to x's dtype (what ``x.mul_(w[:, None])`` computes
    for half x and fp32 w, where PyTorch's broadcast, mixed-dtype kernel is not vectorised). x: [P, N] with a
    contiguous last dim; w: [P]."""
    P, N = x_PN.shape
    if x_PN.stride(-1) != 1 or w_P.shape != (P,):
        raise ValueError(f"scale_rows: x [P, N] with a contiguous last dim and w [P], got "
                         f"{tuple(x_PN.shape)} (strides {x_PN.stride()}) and {tuple(w_P.shape)}")  # fmt: skip
    if x_PN.numel():
        br, bn = 8, min(256, triton.next_power_of_2(N))
        grid = (triton.cdiv(P, br), triton.cdiv(N, bn))
        _scale_rows[grid](x_PN, w_P.contiguous(), P, N=N, sx=x_PN.stride(0), BR=br, BN=bn)
    return x_PN


@triton.jit
def _situ_gmm_groups(z_ptr, src_ptr, w_ptr, h_ptr, offs_ptr, T, I, K, szt, szk, swg, swn, swk, shm,
                     beta, inv_beta, lb, inv_lb, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):  # fmt: skip
    """h[rows of g, cols] = SiTU-GLU(g, u) for program (g, column tile), where [g | u] = z[src rows] @ w[g]^T: the
    rows gathered from z as they are read (``src_row`` T: padding, zeros), the gate's columns and the up's (I
    further down w) in two accumulators, each rounded to h's dtype as the unfused product writes it, then the
    activation of ``kernels.glu`` in fp32."""
    g = tl.program_id(0)
    row_end = tl.load(offs_ptr + g)
    row_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < I
    w_g = w_ptr + g.to(tl.int64) * swg
    for r0 in range(row_start, row_end, BM):
        rows = r0 + tl.arange(0, BM)
        rm = rows < row_end
        src = tl.load(src_ptr + rows, mask=rm, other=T)
        live = rm & (src < T)
        acc_g = tl.full([BM, BN], 0.0, dtype=tl.float32)
        acc_u = tl.full([BM, BN], 0.0, dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            km = ks < K
            a = tl.load(z_ptr + src.to(tl.int64)[:, None] * szt + ks[None, :] * szk,
                        mask=live[:, None] & km[None, :], other=0.0)  # fmt: skip
            wm = km[:, None] & cm[None, :]
            b_g = tl.load(w_g + cols[None, :] * swn + ks[:, None] * swk, mask=wm, other=0.0)
            b_u = tl.load(w_g + (cols + I)[None, :] * swn + ks[:, None] * swk, mask=wm, other=0.0)
            acc_g += tl.dot(a, b_g, input_precision=PREC)
            acc_u += tl.dot(a, b_u, input_precision=PREC)
        gate = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
        up = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
        h = situ(gate, up, beta, inv_beta, lb, inv_lb)
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * shm + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])  # fmt: skip


# ``permute_situ_small``'s launch by rows, as ``SMALL_TILES_BY_ROWS``: half the plain product's columns a program
# (each holds the gate's and the up's: the same weight bytes a program), from bench/grouped_mm_decode.py --situ on
# an H100 (2026-12-07): 12.4 us at 8 sequences (960 rows); k tiles of 128 at 64-128 sequences, 25.9 / 26.4 us
# against 27.0 / 27.4 for the plain product's launch halved (the three steps it replaces: 32.3 / 33.9)
SITU_TILES_BY_ROWS = ((1024, SmallTiles(bn=32)), (None, SmallTiles(bn=32, bk=128)))


def situ_tiles(rows: int) -> SmallTiles:
    """The launch ``permute_situ_small`` takes for ``rows`` rows (``SITU_TILES_BY_ROWS``)."""
    return next(t for below, t in SITU_TILES_BY_ROWS if below is None or rows < below)


def permute_situ_small(
    z_TZ: torch.Tensor, src_row_P: torch.Tensor, offs_E: torch.Tensor, w_GNZ: torch.Tensor, beta: float,
    linear_beta: float, tiles: SmallTiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """h [P, I] = SiTU-GLU of ``grouped_mm(z[src_row], w, offs)``'s gate and up halves (``kernels.glu``'s
    activation, betas ``beta``, ``linear_beta``), in one launch: the permute (``kernels.moe.permute``: src_row T
    reads zeros), the gate/up product and the activation of a decode step's experts, where they were three
    kernels. w: [G, 2I, Z] (gate rows, then up rows); offs: int32 group ends; rows past offs[-1] are left
    unwritten. ``tiles``: the launch (default ``situ_tiles(P)``)."""
    (T, Z), (P,), (G, N2, _) = z_TZ.shape, src_row_P.shape, w_GNZ.shape
    if w_GNZ.shape[2] != Z or N2 % 2 or offs_E.shape != (G,) or z_TZ.dtype != w_GNZ.dtype:
        raise ValueError(f"permute_situ: z [T, Z], w [G, 2I, Z] of z's dtype, offs [G]; got z {tuple(z_TZ.shape)} "
                         f"{z_TZ.dtype}, w {tuple(w_GNZ.shape)} {w_GNZ.dtype}, offs {tuple(offs_E.shape)}")  # fmt: skip
    t = tiles or situ_tiles(P)
    h = torch.empty(P, N2 // 2, device=z_TZ.device, dtype=z_TZ.dtype)
    if P and N2 and G:
        _situ_gmm_groups[(G, triton.cdiv(N2 // 2, t.bn))](
            z_TZ, src_row_P, w_GNZ, h, offs_E, T, N2 // 2, Z, z_TZ.stride(0), z_TZ.stride(1), *w_GNZ.stride(),
            h.stride(0), beta, 1.0 / beta, linear_beta, 1.0 / linear_beta, PREC=_prec(z_TZ.dtype), BM=t.bm,
            BN=t.bn, BK=t.bk, num_warps=t.warps, num_stages=t.stages,
        )  # fmt: skip
    return h


@torch.library.custom_op(op_name("permute_situ_engine"), mutates_args=())
def permute_situ_engine(
    z_TZ: torch.Tensor, src_row_P: torch.Tensor, offs_E: torch.Tensor, w_GNZ: torch.Tensor, beta: float,
    linear_beta: float,
) -> torch.Tensor:  # fmt: skip
    """The rollout engine's SiTU experts up to the down projection (``model.serving.prepare_for_serving`` on CUDA):
    a decode step's rows (up to ``SMALL_ROWS_MAX``) in ``permute_situ_small``'s one launch, a larger step (or any
    off CUDA) as the permute, ``kernels.moe``'s grouped product and ``kernels.glu``'s activation (its kernel on
    CUDA). A custom op: the rule on the row count is made when it runs, not a guard in the compiled MoE block."""
    if z_TZ.is_cuda and src_row_P.shape[0] <= SMALL_ROWS_MAX:
        return permute_situ_small(z_TZ, src_row_P, offs_E.to(torch.int32), w_GNZ, beta, linear_beta)
    from kernels.glu import situ_glu_reference
    from kernels.glu.triton import situ_glu_values
    from kernels.moe import _grouped_mm_forward, _with_zero_row, grouped_mm_backend

    x_PZ = _with_zero_row(z_TZ).index_select(0, src_row_P)  # the permute (``kernels.moe.permute_reference``)
    g_PI, u_PI = _grouped_mm_forward(x_PZ, w_GNZ, offs_E, grouped_mm_backend(x_PZ, w_GNZ)).chunk(2, dim=-1)
    glu = situ_glu_values if z_TZ.is_cuda else situ_glu_reference
    return glu(g_PI, u_PI, beta, linear_beta)


@permute_situ_engine.register_fake
def _(z_TZ, src_row_P, offs_E, w_GNZ, beta, linear_beta):
    return z_TZ.new_empty(src_row_P.shape[0], w_GNZ.shape[1] // 2)


_sum_combine = tl.standard._sum_combine  # tl.sum / tl.cumsum are jit functions the interpreter cannot call here

# slots (tokens x top-k) up to which ``route_tensors_engine`` lays a routing out in two launches: a decode step of up
# to 128 sequences at top-8
ROUTE_SMALL_MAX = 1024

# Whether the engine's routing ops take a prefill step (more than ``ROUTE_SMALL_MAX`` slots or
# ``TOP_SMALL_MAX_ROWS`` rows) on the Triton kernels too (``route_tensors_large``, the one-launch selections), where
# they otherwise run the torch steps eagerly: ``model.serving`` sets it from ``LONGHORIZON_PREFILL_ROUTING`` (on
# unless that says ``torch``). The kernels are held to the torch steps under the interpreter and on a GPU
# (bench/grouped_mm_decode.py --layout). Off until an engine sets it: callers outside one get the torch steps.
_PREFILL_ON_TRITON = False


def set_prefill_routing(on_triton: bool) -> None:
    """Route the engine's prefill steps on the Triton kernels (True, the engine's default) or the torch steps."""
    global _PREFILL_ON_TRITON
    _PREFILL_ON_TRITON = bool(on_triton)


@triton.jit(do_not_specialize=["S"])
def _route_ranks(experts_ptr, rank_ptr, counts_ptr, S, BS: tl.constexpr):
    """Each slot's rank among its expert's slots, from atomic adds on the expert counts (in any order)."""
    s = tl.program_id(0) * BS + tl.arange(0, BS)
    sm = s < S
    ex = tl.load(experts_ptr + s, mask=sm, other=0).to(tl.int32)
    tl.store(rank_ptr + s, tl.atomic_add(counts_ptr + ex, 1, mask=sm).to(tl.int64), mask=sm)


@triton.jit
def _route_groups(offs_ptr, counts_ptr, start_ptr, align, E, BE: tl.constexpr):
    """The padded groups from the counts ``_route_ranks`` left: their ends (``offs``) and starts stored, the counts
    reset to zero for the next step. Returns (counts, padded sizes, ends, starts) over ``BE`` lanes (zero past E)."""
    e = tl.arange(0, BE)
    em = e < E
    counts = tl.load(counts_ptr + e, mask=em, other=0)
    tl.store(counts_ptr + e, tl.full([BE], 0, tl.int32), mask=em)
    padded = (counts + align - 1) // align * align
    ends = tl.associative_scan(padded, 0, _sum_combine)
    starts = ends - padded
    tl.store(offs_ptr + e, ends, mask=em)
    tl.store(start_ptr + e, starts, mask=em)
    return counts, padded, ends, starts


@triton.jit
def _place_slots(experts_ptr, src_row_ptr, row_of_slot_ptr, start_ptr, t, tm, k):
    """Slots ``t`` (mask ``tm``) in their rows: each one's group start plus the rank ``_route_ranks`` left in
    ``row_of_slot``, and the token feeding that row."""
    ex = tl.load(experts_ptr + t, mask=tm, other=0).to(tl.int32)
    row = tl.load(start_ptr + ex, mask=tm, other=0) + tl.load(row_of_slot_ptr + t, mask=tm, other=0)
    tl.store(row_of_slot_ptr + t, row.to(tl.int64), mask=tm)
    tl.store(src_row_ptr + row, (t // k).to(tl.int64), mask=tm)


@triton.jit(do_not_specialize=["S", "T", "P"])  # one compile for every decode batch size
def _route_rows(experts_ptr, src_row_ptr, row_of_slot_ptr, offs_ptr, counts_ptr, start_ptr, S, T, k, P, align, E,
                BE: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    """The layout from the counts and ranks ``_route_ranks`` left (the ranks in ``row_of_slot``), in one program:
    the padded groups' ends (``_route_groups``), T in every row, then each slot's row and the token feeding it
    (``_place_slots``)."""
    _route_groups(offs_ptr, counts_ptr, start_ptr, align, E, BE)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        tl.store(src_row_ptr + p, tl.full([BP], 0, tl.int64) + T, mask=p < P)
    tl.debug_barrier()  # the starts and the tail rows' T stored before they are read or overwritten
    for s0 in range(0, S, BS):
        t = s0 + tl.arange(0, BS)
        _place_slots(experts_ptr, src_row_ptr, row_of_slot_ptr, start_ptr, t, t < S, k)


@triton.jit(do_not_specialize=["T", "P"])
def _route_starts(src_row_ptr, offs_ptr, counts_ptr, start_ptr, T, P, align, E, BE: tl.constexpr,
                  BP: tl.constexpr):  # fmt: skip
    """A large step's groups (``_route_groups``) in one program, and T in each group's padding rows and in the tail
    rows past the last group (every row no slot takes). ``_route_place`` puts the slots in their rows after it."""
    counts, padded, ends, starts = _route_groups(offs_ptr, counts_ptr, start_ptr, align, E, BE)
    em = tl.arange(0, BE) < E
    for j in range(0, align - 1):  # a group's padding rows: at most align - 1 past its slots
        row = starts + counts + j
        tl.store(src_row_ptr + row, tl.full([BE], 0, tl.int64) + T, mask=em & (row < ends))
    last = tl.reduce(padded, 0, _sum_combine)  # the last group's end (padded is zero past E)
    for p0 in range(last, P, BP):  # the tail only: at most E (align - 1) rows, not the whole buffer
        p = p0 + tl.arange(0, BP)
        tl.store(src_row_ptr + p, tl.full([BP], 0, tl.int64) + T, mask=p < P)


@triton.jit(do_not_specialize=["S"])
def _route_place(experts_ptr, src_row_ptr, row_of_slot_ptr, start_ptr, S, k, BS: tl.constexpr):
    """``_place_slots`` for a program's ``BS`` slots, after ``_route_starts``."""
    t = tl.program_id(0) * BS + tl.arange(0, BS)
    _place_slots(experts_ptr, src_row_ptr, row_of_slot_ptr, start_ptr, t, t < S, k)


_ROUTE_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _route_scratch(device: torch.device, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [E], starts [E]) int32 of the layout kernels on ``device``, made once (zeros: every layout leaves
    the counts at zero), so a captured CUDA graph replays with the same buffers."""
    key = (device, num_experts)
    if key not in _ROUTE_SCRATCH:
        z = torch.zeros(2 * num_experts, dtype=torch.int32, device=device)
        _ROUTE_SCRATCH[key] = (z[:num_experts], z[num_experts:])
    return _ROUTE_SCRATCH[key]


def _layout_buffers(experts_TK: torch.Tensor, num_experts: int, align: int):
    """A Triton layout's outputs, unwritten (src_row_P [S + E (align - 1)], row_of_slot_S, offs_E), and its scratch
    (counts, starts)."""
    S, dev = experts_TK.numel(), experts_TK.device
    src_row_P = torch.empty(S + num_experts * (align - 1), dtype=torch.long, device=dev)
    row_of_slot_S = torch.empty(S, dtype=torch.long, device=dev)
    offs_E = torch.empty(num_experts, dtype=torch.int32, device=dev)
    return (src_row_P, row_of_slot_S, offs_E), _route_scratch(dev, num_experts)


def route_tensors_small(experts_TK: torch.Tensor, num_experts: int, align: int) -> tuple[torch.Tensor, ...]:
    """``kernels.moe.route_tensors`` in two launches for up to ``ROUTE_SMALL_MAX`` slots (a decode step's layout,
    where the compiled one ran about eight kernels, ~12 us a MoE layer on an H100): the slots' ranks by atomic adds
    (``_route_ranks``), then the rows in one program (``_route_rows``). The same groups, group ends, padding rows
    and dtypes, each slot in its expert's group, but the rows inside a group in any order, which changes no
    product: each row of the grouped GEMMs is computed alone, and the combine reads every slot's row where it is."""
    T, k = experts_TK.shape
    S = T * k
    if S > ROUTE_SMALL_MAX or num_experts < 1 or align < 1:
        raise ValueError(f"route_tensors_small: at most {ROUTE_SMALL_MAX} slots, experts and align >= 1; got "
                         f"[T, k] = [{T}, {k}], {num_experts} experts, align {align}")  # fmt: skip
    (src_row_P, row_of_slot_S, offs_E), (counts, starts) = _layout_buffers(experts_TK, num_experts, align)
    P, flat = src_row_P.shape[0], experts_TK.reshape(-1)
    if S:
        _route_ranks[(triton.cdiv(S, 128),)](flat, row_of_slot_S, counts, S, BS=128, num_warps=4)
    _route_rows[(1,)](
        flat, src_row_P, row_of_slot_S, offs_E, counts, starts, S, T, max(k, 1), P, align, num_experts,
        BE=triton.next_power_of_2(num_experts), BS=128, BP=1024, num_warps=4,
    )  # fmt: skip
    return src_row_P, row_of_slot_S, offs_E


def route_tensors_large(experts_TK: torch.Tensor, num_experts: int, align: int) -> tuple[torch.Tensor, ...]:
    """``route_tensors_small`` for any number of slots (a prefill step's: 16K tokens x 8 = 131K at gpu_1b), in
    three launches: the ranks by atomic adds (``_route_ranks``), the groups (``_route_starts``, one program over
    the experts), then the slots' rows, a program per 1,024 slots (``_route_place``), where the eager sort path
    ran about 25 ops a MoE layer (~0.9 ms of a slow host's time a layer in a prefill step). The same groups, group
    ends, padding rows and dtypes as ``route_tensors``, the rows inside a group in any order."""
    T, k = experts_TK.shape
    S = T * k
    if num_experts < 1 or align < 1:
        raise ValueError(f"route_tensors_large: experts and align >= 1; got {num_experts} experts, align {align}")
    (src_row_P, row_of_slot_S, offs_E), (counts, starts) = _layout_buffers(experts_TK, num_experts, align)
    P, flat, bs = src_row_P.shape[0], experts_TK.reshape(-1), 1024
    if S:
        _route_ranks[(triton.cdiv(S, bs),)](flat, row_of_slot_S, counts, S, BS=bs, num_warps=4)
    _route_starts[(1,)](src_row_P, offs_E, counts, starts, T, P, align, num_experts,
                        BE=triton.next_power_of_2(num_experts), BP=1024, num_warps=4)  # fmt: skip
    if S:
        _route_place[(triton.cdiv(S, bs),)](flat, src_row_P, row_of_slot_S, starts, S, max(k, 1), BS=bs, num_warps=4)
    return src_row_P, row_of_slot_S, offs_E


@torch.library.custom_op(op_name("route_tensors_engine"), mutates_args=())
def route_tensors_engine(
    experts_TK: torch.Tensor, num_experts: int, align: int, counting_max: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.moe.route_tensors`` for the rollout engine's MoE blocks (``model.serving.prepare_for_serving`` on
    CUDA): a step of up to ``ROUTE_SMALL_MAX`` slots on ``route_tensors_small`` (two launches), a larger one (prefill
    chunks) on ``route_tensors_large`` (three) with prefill routing on Triton (``set_prefill_routing``), otherwise
    (and off CUDA) on ``route_tensors`` ranking by sort. A custom op, so the choice is made when it runs: a rule on
    the traced slot count in a compiled MoE block would be a guard, and a step across it a second compile.
    ``counting_max``: unused (the signature of ``route_tensors``, which ``kernels.moe.route_layout`` calls)."""
    from kernels.moe import route_tensors

    if experts_TK.is_cuda and experts_TK.numel() <= ROUTE_SMALL_MAX:
        return route_tensors_small(experts_TK, num_experts, align)
    if experts_TK.is_cuda and _PREFILL_ON_TRITON:
        return route_tensors_large(experts_TK, num_experts, align)
    return route_tensors(experts_TK, num_experts, align, 0)


@route_tensors_engine.register_fake
def _(experts_TK, num_experts, align, counting_max):
    S = experts_TK.numel()
    rows = experts_TK.new_empty(S + num_experts * (align - 1), dtype=torch.long)
    return rows, experts_TK.new_empty(S, dtype=torch.long), experts_TK.new_empty(num_experts, dtype=torch.int32)


# experts up to which ``top_experts_engine`` and ``select_experts_engine`` select a step's top-k in one Triton launch
# (a row a program, any number of rows); rows up to which they do so for every engine: a decode step's
TOP_SMALL_MAX_EXPERTS = 1024
TOP_SMALL_MAX_ROWS = 1024


@triton.jit
def _take_largest(x, taken, e, BE: tl.constexpr):
    """One round of the one-launch top-k: the largest of ``x`` not yet ``taken`` (a -inf included) at its lowest
    index ``e``, as a stable descending sort orders ties. Returns (value, index, taken with it)."""
    m = tl.reduce(tl.where(taken, -float("inf"), x), 0, tl.standard._elementwise_max)
    j = tl.reduce(tl.where(~taken & (x == m), e, BE), 0, tl.standard._elementwise_min)
    return m, j, taken | (e == j)


@triton.jit
def _top_small(x_ptr, vals_ptr, idx_ptr, E, sx, N: tl.constexpr, BE: tl.constexpr):
    """Row ``program_id`` of ``top_experts``: the N largest scores and their experts in descending order, ties to
    the lower expert, as a stable descending sort's first N: N rounds of ``_take_largest``."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    x = tl.load(x_ptr + row * sx + e, mask=e < E, other=-float("inf")).to(tl.float32)
    x = tl.where(x == x, x, -float("inf"))  # NaN (a CUDA graph's padding rows) as -inf: an expert id all the same
    taken = e >= E
    for i in tl.static_range(N):
        m, j, taken = _take_largest(x, taken, e, BE)
        tl.store(vals_ptr + row * N + i, m)
        tl.store(idx_ptr + row * N + i, j.to(tl.int64))


def top_small_takes(biased_TE: torch.Tensor, n: int) -> bool:
    """Whether ``top_experts_small`` takes these scores: fp32 [T, E <= TOP_SMALL_MAX_EXPERTS], 1 <= n <= E."""
    E = biased_TE.shape[1]
    return biased_TE.dtype == torch.float32 and 1 <= n <= E <= TOP_SMALL_MAX_EXPERTS


def _engine_takes_rows(x_TE: torch.Tensor, n: int) -> bool:
    """Whether the engine's one-launch top-k / selection takes these scores: on CUDA, the kernel takes them, and a
    decode step's rows (or any, with prefill routing on Triton)."""
    rows_ok = x_TE.shape[0] <= TOP_SMALL_MAX_ROWS or _PREFILL_ON_TRITON
    return x_TE.is_cuda and rows_ok and top_small_takes(x_TE, n)


def top_experts_small(biased_TE: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.moe.top_experts`` (the same values, experts and order) in one launch, a program a row, for rows of
    up to ``TOP_SMALL_MAX_EXPERTS`` fp32 scores: a decode step's, where the sort took a single-block radix sort a
    MoE layer, and a prefill step's, where it took a segmented sort and its setup. A NaN score counts as -inf (a
    sort would order it first): a CUDA graph's padding rows, whose values nothing reads, still get expert ids in
    range."""
    T, E = biased_TE.shape
    if not top_small_takes(biased_TE, n):
        raise ValueError(f"top_experts_small: fp32 scores [T, E <= {TOP_SMALL_MAX_EXPERTS}] "
                         f"and 1 <= n <= E, got {biased_TE.dtype} {tuple(biased_TE.shape)} and n = {n}")  # fmt: skip
    vals = torch.empty(T, n, dtype=torch.float32, device=biased_TE.device)
    idx = torch.empty(T, n, dtype=torch.long, device=biased_TE.device)
    if T:
        x = biased_TE if biased_TE.stride(-1) == 1 else biased_TE.contiguous()
        _top_small[(T,)](x, vals, idx, E, x.stride(0), N=n, BE=triton.next_power_of_2(E), num_warps=4)
    return vals, idx


@triton.jit
def _select_small(x_ptr, bias_ptr, idx_ptr, w_ptr, E, sx, scaling, N: tl.constexpr, NP: tl.constexpr,
                  BE: tl.constexpr, RENORM: tl.constexpr):  # fmt: skip
    """Row ``program_id`` of ``MoEGate``'s selection from its logits: scores sigmoid(x), the N largest of scores +
    bias taken as ``_top_small`` takes them (ties to the lower expert), and their unbiased scores as the weights,
    renormalised over the N (``RENORM``) and scaled (``model.moe.routing_weights``)."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    em = e < E
    x = tl.load(x_ptr + row * sx + e, mask=em, other=0.0).to(tl.float32)
    score = 1.0 / (1.0 + tl.exp(-x))
    biased = score + tl.load(bias_ptr + e, mask=em, other=0.0)
    biased = tl.where(em & (biased == biased), biased, -float("inf"))  # NaN (padding rows) as -inf, as in _top_small
    taken = e >= E
    n = tl.arange(0, NP)
    w = tl.full([NP], 0.0, dtype=tl.float32)
    for i in tl.static_range(N):
        _, j, taken = _take_largest(biased, taken, e, BE)
        w = tl.where(n == i, tl.reduce(tl.where(e == j, score, 0.0), 0, _sum_combine), w)
        tl.store(idx_ptr + row * N + i, j.to(tl.int64))
    if RENORM:
        w = w / tl.maximum(tl.reduce(w, 0, _sum_combine), 1e-20)
    tl.store(w_ptr + row * N + n, w * scaling, mask=n < N)


def select_experts_small(
    logits_TE: torch.Tensor, bias_E: torch.Tensor, n: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, n], weights [T, n] fp32) of ``MoEGate``'s selection from fp32 router logits (sigmoid scores,
    the top n of scores + bias, the chosen unbiased scores renormalised and scaled) in one launch, a program a row:
    a decode step's, where the compiled block ran the sigmoid, the top-k and the weights as three kernels. The
    shapes ``top_small_takes`` takes; a NaN logit's expert counts as -inf (``top_experts_small``)."""
    T, E = logits_TE.shape
    if not top_small_takes(logits_TE, n) or bias_E.shape != (E,):
        raise ValueError(f"select_experts_small: fp32 logits [T, E <= {TOP_SMALL_MAX_EXPERTS}]"
                         f", bias [E] and 1 <= n <= E, got {logits_TE.dtype} {tuple(logits_TE.shape)}, bias "
                         f"{tuple(bias_E.shape)} and n = {n}")  # fmt: skip
    idx = torch.empty(T, n, dtype=torch.long, device=logits_TE.device)
    w = torch.empty(T, n, dtype=torch.float32, device=logits_TE.device)
    if T:
        x = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
        _select_small[(T,)](x, bias_E.float().contiguous(), idx, w, E, x.stride(0), float(scaling), N=n,
                            NP=triton.next_power_of_2(n), BE=triton.next_power_of_2(E), RENORM=renormalize,
                            num_warps=4)  # fmt: skip
    return idx, w


@torch.library.custom_op(op_name("select_experts_engine"), mutates_args=())
def select_experts_engine(
    logits_TE: torch.Tensor, bias_E: torch.Tensor, n: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoEGate``'s selection from its logits for the rollout engine's routers (``model.serving`` on CUDA): a
    decode step's rows in ``select_experts_small``'s one launch, a prefill step's too with prefill routing on Triton
    (``set_prefill_routing``; the gate's sigmoid, sort and weights are about ten ops a MoE layer there); otherwise,
    off CUDA, or for scores it does not take, as the gate computes them (``model.moe.select_experts``). A custom op:
    the rule is made when it runs."""
    if _engine_takes_rows(logits_TE, n):
        return select_experts_small(logits_TE, bias_E, n, renormalize, scaling)
    from model.moe import select_experts

    experts_TK, weights_TK = select_experts(logits_TE, bias_E, n, renormalize, scaling)
    return experts_TK.contiguous(), weights_TK.contiguous()


@select_experts_engine.register_fake
def _(logits_TE, bias_E, n, renormalize, scaling):
    T = logits_TE.shape[0]
    return logits_TE.new_empty(T, n, dtype=torch.long), logits_TE.new_empty(T, n, dtype=torch.float32)


@torch.library.custom_op(op_name("top_experts_engine"), mutates_args=())
def top_experts_engine(biased_TE: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.moe.top_experts`` for the rollout engine's routers (``model.serving.prepare_for_serving`` on CUDA):
    a decode step's rows on ``top_experts_small``, a prefill step's too with prefill routing on Triton; otherwise
    sorted as ``top_experts`` sorts. A custom op: the rule is made when it runs, not a guard in the compiled MoE
    block."""
    from model.moe import top_experts

    if _engine_takes_rows(biased_TE, n):
        return top_experts_small(biased_TE, n)
    vals, idx = top_experts(biased_TE, n)
    return vals.contiguous(), idx.contiguous()


@top_experts_engine.register_fake
def _(biased_TE, n):
    T = biased_TE.shape[0]
    return biased_TE.new_empty(T, n), biased_TE.new_empty(T, n, dtype=torch.long)
