"""Chunked KDA in PyTorch: the CPU path (and the algorithm the Triton kernels implement).

Per sequence, tokens are cut into chunks of C = 64 (the last one padded with q = k = v = 0,
g = 0, beta = 0, which leaves the state untouched). Inside a chunk, with G the inclusive
cumulative log-decay from the chunk start (fp32) and S the state entering the chunk:

    A_kk[r, j] = beta_r sum_c k_rc k_jc exp(G_rc - G_jc)      j <  r
    A_qk[r, j] = scale sum_c q_rc k_jc exp(G_rc - G_jc)       j <= r
    [W | U]    = (I + A_kk)^-1 Diag(beta) [exp(G) * K | V]    (UT transform, a triangular solve)
    V~         = U - W S
    O          = (scale exp(G) * Q) S + A_qk V~
    S'         = exp(G_last) * S + (exp(G_last - G) * K)^T V~

The scores A_* are matmuls of factored operands. A factor exp(+G) can only be paired with a
factor exp(-G) if the span stays small, so they are formed per 16-token sub-tile
(``intra_chunk_scores``): diagonal sub-tiles shift both exponents to the sub-tile midpoint
(each factor spans <= 8 tokens: <= 40 nats at g >= -5); off-diagonal sub-tile pairs use a
reference point at the start of the row sub-tile, so both factors have non-positive
exponents and are safe with any gate. ``dense_chunk_scores`` is the naive alternative (one
64-token tile, up to 320 nats at g = -5), kept to show in tests why it is not used.

Deviations from flash-linear-attention's Triton kernel: log-decay stays in natural-log units
(exp, not exp2), and inputs of any floating dtype are computed in fp32 on CPU (fp64 stays
fp64), because CPU bf16 matmuls are slow and round every product; outputs are cast back.
The backward is autograd through this forward. Sequences are laid out as a flat list of
chunks; the only sequential part is the state pass over chunk positions, vectorised over
sequences and heads. On CPU, ``chunk_kda`` sends sequences of <= RECURRENT_MAX_LEN tokens
(decode steps) to the step recurrence rather than padding each to a 64-token chunk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.kda.naive import _check_inputs, check_gate
from kernels.kda.recurrent import fused_recurrent_kda

CHUNK = 64
SUB = 16
DEFAULT_LOWER_BOUND = -5.0
CHECK_ENV = "LONGHORIZON_KDA_CHECK"
RECURRENT_MAX_LEN = 16  # CPU: sequences this short are cheaper token by token than as a chunk


@dataclass
class ChunkLayout:
    """Where every token sits once sequences are padded to whole chunks.

    token_of_slot_S: token index feeding each of the S = num_chunks * C slots (T = padding).
    slot_of_token_T: slot holding each token, for gathering the outputs back.
    chunk_start_N / num_chunks_N: the first chunk and the chunk count of each sequence.
    """

    token_of_slot_S: torch.Tensor
    slot_of_token_T: torch.Tensor
    chunk_start_N: torch.Tensor
    num_chunks_N: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return self.token_of_slot_S.numel() // CHUNK


def chunk_layout(cu_seqlens_N1: torch.Tensor, T: int) -> ChunkLayout:
    """Pad every sequence of the packed [T] token axis to whole chunks, chunks in sequence order."""
    cu = cu_seqlens_N1.to(device="cpu", dtype=torch.long)
    lens_N = cu[1:] - cu[:-1]
    N = lens_N.numel()
    nch_N = (lens_N + CHUNK - 1) // CHUNK
    chunk_start_N = torch.cumsum(nch_N, 0) - nch_N
    slot_start_N = chunk_start_N * CHUNK
    seq_of_slot = torch.repeat_interleave(torch.arange(N), nch_N * CHUNK)
    offset_S = torch.arange(seq_of_slot.numel()) - slot_start_N[seq_of_slot]
    in_seq_S = offset_S < lens_N[seq_of_slot]
    token_of_slot_S = torch.where(in_seq_S, cu[:-1][seq_of_slot] + offset_S, torch.full_like(offset_S, T))
    seq_of_token = torch.repeat_interleave(torch.arange(N), lens_N)
    slot_of_token_T = slot_start_N[seq_of_token] + torch.arange(T) - cu[:-1][seq_of_token]
    return ChunkLayout(token_of_slot_S, slot_of_token_T, chunk_start_N, nch_N)


def to_chunks(x_TH_: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, H, *] -> [num_chunks, H, C, *], padding slots filled with zeros."""
    pad = x_TH_.new_zeros((1, *x_TH_.shape[1:]))
    x_SH_ = torch.cat([x_TH_, pad]).index_select(0, layout.token_of_slot_S.to(x_TH_.device))
    x_NcCH_ = x_SH_.unflatten(0, (layout.num_chunks, CHUNK))
    return x_NcCH_.transpose(1, 2)


def from_chunks(x_NcHC_: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[num_chunks, H, C, *] -> [T, H, *] (padding slots dropped)."""
    x_SH_ = x_NcHC_.transpose(1, 2).flatten(0, 1)
    return x_SH_.index_select(0, layout.slot_of_token_T.to(x_SH_.device))


def dense_chunk_scores(a_CK: torch.Tensor, k_CK: torch.Tensor, G_CK: torch.Tensor) -> torch.Tensor:
    """The naive dense tile (a * exp(G)) (k * exp(-G))^T over a whole chunk, for any C.

    Exact in exact arithmetic, but exp(-G) spans the whole chunk: at g = -5 a 64-token tile
    needs e^320, which overflows fp32 and bf16 (max ~e^88.7). Not used by chunk_kda.
    Operands are cast to a's dtype before the matmul, as a kernel feeding bf16 tensor cores does.
    """
    a_op = (a_CK * G_CK.exp()).to(a_CK.dtype)
    k_op = (k_CK * (-G_CK).exp()).to(a_CK.dtype)
    return a_op @ k_op.transpose(-1, -2)


def _tile_map(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower tile pairs (i > j) and, for each of the n*n tiles of a chunk, its source in
    cat([diagonal tiles (n), lower pairs (p), zero tile (1)])."""
    ii, jj = torch.tril_indices(n, n, offset=-1)
    src = torch.full((n, n), n + len(ii), dtype=torch.long)
    src[torch.arange(n), torch.arange(n)] = torch.arange(n)
    src[ii, jj] = n + torch.arange(len(ii))
    return ii, jj, src.flatten()


def intra_chunk_scores(
    rows: tuple[torch.Tensor, ...], k_CK: torch.Tensor, G_CK: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """sum_c a_rc k_jc exp(G_rc - G_jc) for j <= r, per row operand a, from 16-token sub-tiles.

    rows: operands a [..., C, K] (q and k share the column factors). Returns one [..., C, C]
    score per operand, zero above the diagonal (the diagonal itself is kept). G stays in its
    own (fp32) dtype; the scaled operands are cast to k's dtype before each matmul, as a
    kernel feeding bf16 tensor cores does (chunk_kda passes fp32 on CPU).
    """
    op, C = k_CK.dtype, G_CK.shape[-2]
    n = C // SUB
    G_nsK, k_nsK = G_CK.unflatten(-2, (n, SUB)), k_CK.unflatten(-2, (n, SUB))
    # Diagonal tiles: both factors shifted to the tile midpoint, each spans <= SUB/2 tokens.
    G_mid = G_nsK[..., SUB // 2 : SUB // 2 + 1, :]
    k_diag = (k_nsK * (G_mid - G_nsK).exp()).to(op)
    # Off-diagonal pair (i > j): exp(G_r - G_c) = exp(G_r - G_first_i) exp(G_first_i - G_last_j)
    # exp(G_last_j - G_c), three non-positive exponents, so safe with any gate.
    G_first, G_last = G_nsK[..., :1, :], G_nsK[..., -1:, :]
    ii, jj, src = (t.to(G_CK.device) for t in _tile_map(n))
    k_pair = (k_nsK * (G_last - G_nsK).exp())[..., jj, :, :].to(op)
    bridge_p1K = (G_first[..., ii, :, :] - G_last[..., jj, :, :]).exp()
    causal = torch.ones(SUB, SUB, dtype=torch.bool, device=G_CK.device).tril()
    row_mid, row_first = (G_nsK - G_mid).exp(), (G_nsK - G_first).exp()  # shared by all rows
    out = []
    for a_CK in rows:
        a_nsK = a_CK.unflatten(-2, (n, SUB))
        diag_nss = (a_nsK * row_mid).to(op) @ k_diag.transpose(-1, -2)
        diag_nss = torch.where(
            causal, diag_nss, torch.zeros((), dtype=diag_nss.dtype, device=diag_nss.device)
        )
        a_pair = ((a_nsK * row_first)[..., ii, :, :] * bridge_p1K).to(op)
        off_pss = a_pair @ k_pair.transpose(-1, -2)
        tiles = torch.cat([diag_nss, off_pss, torch.zeros_like(diag_nss[..., :1, :, :])], dim=-3)
        A_nnss = tiles.index_select(-3, src).unflatten(-3, (n, n))
        out.append(A_nnss.transpose(-3, -2).reshape(*A_nnss.shape[:-4], C, C))
    return tuple(out)


def ut_transform(
    A_kk_CC: torch.Tensor, k_CK: torch.Tensor, v_CV: torch.Tensor, G_CK: torch.Tensor, beta_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """W = M (exp(G) * K), U = M V with M = (I + StrictTril(A_kk))^-1 Diag(beta)."""
    K = k_CK.shape[-1]
    rhs = beta_C[..., None] * torch.cat([k_CK * G_CK.exp(), v_CV], dim=-1)
    # unitriangular: the (masked) diagonal of A_kk is ignored and taken as 1.
    WU = torch.linalg.solve_triangular(A_kk_CC, rhs, upper=False, unitriangular=True)
    return WU[..., :K], WU[..., K:]


def state_pass(
    W_NcHCK: torch.Tensor,
    U_NcHCV: torch.Tensor,
    kdec_NcHCK: torch.Tensor,
    decay_NcHK: torch.Tensor,
    state_NHKV: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential part: walk chunk positions, all sequences and heads at once.

    Sequences are sorted by chunk count, so at step s the active ones are a prefix. Inputs are
    gathered once into step order and split (not indexed per step: the backward of a per-step
    index or slice materialises a full-size zero gradient each time, quadratic in chunks).
    Returns the state entering each chunk [Nc, H, K, V], V~ per chunk, and the final states.
    """
    order_N = torch.argsort(layout.num_chunks_N, descending=True, stable=True)
    nch_sorted, start_sorted = layout.num_chunks_N[order_N], layout.chunk_start_N[order_N]
    steps = int(nch_sorted[0]) if len(nch_sorted) else 0
    active = [int((nch_sorted > s).sum()) for s in range(steps)]
    step_chunks = torch.cat(
        [start_sorted[:a] + s for s, a in enumerate(active)] or [torch.zeros(0, dtype=torch.long)]
    )
    step_chunks = step_chunks.to(W_NcHCK.device)
    Ws, Us, kdecs, decays = (x[step_chunks].split(active) for x in (W_NcHCK, U_NcHCV, kdec_NcHCK, decay_NcHK))
    N = state_NHKV.shape[0]
    S_NHKV = state_NHKV[order_N.to(state_NHKV.device)]
    h_steps, vt_steps = [], []
    for s, a in enumerate(active):
        h_aHKV, rest = S_NHKV.split([a, N - a])
        vt_aHCV = Us[s] - Ws[s] @ h_aHKV
        S_new = decays[s][..., None] * h_aHKV + kdecs[s].transpose(-1, -2) @ vt_aHCV
        S_NHKV = torch.cat([S_new, rest])
        h_steps.append(h_aHKV)
        vt_steps.append(vt_aHCV)
    final_NHKV = S_NHKV[torch.argsort(order_N).to(S_NHKV.device)]
    if not steps:
        empty = W_NcHCK.new_zeros((0, W_NcHCK.shape[1], W_NcHCK.shape[-1], U_NcHCV.shape[-1]))
        return empty, U_NcHCV[:0], final_NHKV
    chunk_order = torch.argsort(step_chunks)
    return torch.cat(h_steps)[chunk_order], torch.cat(vt_steps)[chunk_order], final_NHKV


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    lower_bound: float | None = DEFAULT_LOWER_BOUND,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, same signature and conventions as ``naive_recurrent_kda``.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [N, H, K, V] fp32; B = 1 with
    ``cu_seqlens`` (packed sequences, no state crosses a boundary); scale defaults to K**-0.5.

    Contract: the per-channel log-decay satisfies lower_bound <= g <= 0 (g_min = -5 by
    default, the model's bounded gate). The 16-token sub-tiles keep every exponent within
    8 * |g_min| = 40 nats; the path stays finite down to about g = -11 in fp32, and is wrong
    or non-finite beyond. Set LONGHORIZON_KDA_CHECK=1 to verify the bound (raises ValueError;
    lower_bound=None skips the check).

    Returns o [B, T, H, V] in q's dtype and, if asked, the final state [N, H, K, V] (fp32;
    fp64 for fp64 inputs). CUDA tensors go to the Triton kernels. On CPU, sequences of at most
    RECURRENT_MAX_LEN tokens (decode steps) take the step recurrence instead of a mostly-padding
    64-token chunk: same function, 10-40x less work for a batch of single tokens.
    """
    if lower_bound is not None and os.environ.get(CHECK_ENV, "0") not in ("", "0"):
        check_gate(g, lower_bound)
    if q.is_cuda:
        from kernels.kda.triton import chunk_kda_triton

        return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T = q.shape[:2]
    cu = (torch.arange(B + 1) * T) if cu_seqlens is None else cu_seqlens.to("cpu", torch.long)
    short_N = (cu[1:] - cu[:-1]) <= RECURRENT_MAX_LEN
    if bool(short_N.all()) and N:
        return fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    if bool(short_N.any()):
        return _split_short_and_long(q, k, v, g, beta, scale, initial_state, output_final_state, cu, short_N)
    return chunked_kda_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def chunked_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked algorithm itself, for every sequence length (chunk_kda's CPU path)."""
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1) * T
    layout = chunk_layout(cu_seqlens, B * T)

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return to_chunks(x.reshape(B * T, H, x.shape[3] if x.dim() == 4 else 1).to(dt), layout)

    q_c, k_c, v_c, g_c = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    beta_c = chunks(beta).squeeze(-1)
    G_c = g_c.cumsum(dim=-2)  # fp32 cumulative log-decay from each chunk start
    # beta scales A_kk's rows: fold it into the row operand (C x K) rather than the scores (C x C).
    A_qk, A_kk = intra_chunk_scores((q_c, k_c * beta_c[..., None]), k_c, G_c)
    W_c, U_c = ut_transform(A_kk, k_c, v_c, G_c, beta_c)
    G_last = G_c[..., -1:, :]
    kdec_c = k_c * (G_last - G_c).exp()
    S0 = q.new_zeros((N, H, K, V), dtype=dt) if initial_state is None else initial_state.to(dt)
    h_c, vt_c, final = state_pass(W_c, U_c, kdec_c, G_last.squeeze(-2).exp(), S0, layout)
    o_c = (q_c * G_c.exp()) @ h_c + A_qk @ vt_c
    o = from_chunks(o_c, layout).reshape(B, T, H, V).to(q.dtype)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return o, (final.to(state_dtype) if output_final_state else None)


def _split_short_and_long(q, k, v, g, beta, scale, initial_state, output_final_state, cu, short_N):
    """Packed batch mixing decode steps and prefills: short sequences through the recurrence,
    the rest through chunks, outputs and states put back in place (differentiably)."""
    lens_N = cu[1:] - cu[:-1]
    token_seq = torch.repeat_interleave(torch.arange(len(lens_N)), lens_N)
    parts, finals, order = [], [], []
    for fn, sel_N in ((fused_recurrent_kda, short_N), (chunked_kda_torch, ~short_N)):
        seq_ids = torch.nonzero(sel_N).flatten()
        tok = torch.nonzero(sel_N[token_seq]).flatten().to(q.device)
        sub_cu = torch.cat([torch.zeros(1, dtype=torch.long), lens_N[seq_ids].cumsum(0)])
        h0 = None if initial_state is None else initial_state[seq_ids.to(initial_state.device)]
        xs = (x.index_select(1, tok) for x in (q, k, v, g, beta))
        o_part, fin = fn(*xs, scale, h0, output_final_state, sub_cu)
        parts.append((tok, o_part))
        finals.append(fin)
        order.append(seq_ids)
    B, T, H, _ = q.shape
    o = q.new_zeros((B, T, H, v.shape[-1]))
    for tok, o_part in parts:
        o = o.index_copy(1, tok, o_part)
    if not output_final_state:
        return o, None
    inverse = torch.argsort(torch.cat(order)).to(finals[0].device)
    return o, torch.cat(finals)[inverse]
