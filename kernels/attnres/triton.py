"""``kernels.attnres.attn_res_mix_norm_triton``'s kernel: one program per token row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.sum is an @jit function of triton.language.standard, which the interpreter runs only if TRITON_INTERPRET was
# set before triton was imported: tl.reduce with its combine function instead (as kernels/conv/triton.py does)
_sum_combine = tl.standard._sum_combine


@triton.jit
def _mix_norm_row(v_ptr, q_ptr, kw_ptr, ow_ptr, y_ptr, S, D, sv_s, sv_n, sy_n, eps, out_eps,
                  BD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    dm = d < D
    q = tl.load(q_ptr + d, mask=dm, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + d, mask=dm, other=0.0).to(tl.float32)
    m = tl.full([], -float("inf"), tl.float32)
    den = tl.full([], 0.0, tl.float32)
    acc = tl.full([BD], 0.0, tl.float32)
    for s in range(0, S):
        v = tl.load(v_ptr + s * sv_s + row * sv_n + d, mask=dm, other=0.0).to(tl.float32)
        key = v * (1.0 / tl.sqrt(tl.reduce(v * v, 0, _sum_combine) / D + eps)) * kw
        logit = tl.reduce(key * q, 0, _sum_combine)
        m_new = tl.maximum(m, logit)
        scale = tl.exp(m - m_new)  # the softmax over the sources, online: earlier terms rescaled
        p = tl.exp(logit - m_new)
        acc = acc * scale + p * v
        den = den * scale + p
        m = m_new
    h = (acc / den).to(y_ptr.dtype.element_ty).to(tl.float32)  # the mix in the sources' dtype, as the reference
    ow = tl.load(ow_ptr + d, mask=dm, other=0.0).to(tl.float32)
    y = h * (1.0 / tl.sqrt(tl.reduce(h * h, 0, _sum_combine) / D + out_eps)) * ow
    tl.store(y_ptr + row * sy_n + d, y.to(y_ptr.dtype.element_ty), mask=dm)


def mix_norm_rows(
    query: torch.Tensor, key_weight: torch.Tensor, eps: float, out_weight: torch.Tensor, out_eps: float,
    v_SND: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """y [..., D] in the sources' dtype from v [S, ..., D] (S >= 1, last dim contiguous)."""
    S, D = v_SND.shape[0], v_SND.shape[-1]
    if S < 1 or any(t.shape != (D,) for t in (query, key_weight, out_weight)):
        raise ValueError(f"attn_res_mix_norm: sources [S >= 1, ..., D] and weights [D], got {tuple(v_SND.shape)} and "
                         f"{[tuple(t.shape) for t in (query, key_weight, out_weight)]}")  # fmt: skip
    v = v_SND.reshape(S, -1, D)
    if v.stride(-1) != 1:
        v = v.contiguous()
    N = v.shape[1]
    y = torch.empty(N, D, device=v.device, dtype=v.dtype)
    if N:
        _mix_norm_row[(N,)](v, query, key_weight, out_weight, y, S, D, v.stride(0), v.stride(1), y.stride(0),
                            float(eps), float(out_eps), BD=triton.next_power_of_2(D), num_warps=4)  # fmt: skip
    return y.view(v_SND.shape[1:])
