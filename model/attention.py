"""Causal attention over every sequence of a micro-batch in one call (the MLA expanded form's fast path).

Inputs are per-head q, k [B, T, H, Dqk] and v [B, T, H, Dv] of a packed ([1, T] with cu_seqlens) or
padded ([B, T]) batch; rows are flattened to R = B * T tokens and each sequence attends causally
within itself, exactly what ``GatedMLA`` computes with one SDPA per sequence (the reference,
``model.fast`` op "attention" = "loop"). Two one-call forms:

* ``varlen``: PyTorch's varlen flash attention (``torch.nn.attention.varlen.varlen_attn``, FA2 inside
  PyTorch, CUDA) over ``SeqLayout.cu_seqlens_N1``. FA2 has fp16/bf16 kernels only (fp32 inputs take
  ``flex``) and wants one head size for q, k and v, so v is zero-padded to Dqk and the padding
  columns of the output dropped (exact; 1.5x the P V product at gpu_1b's 192 / 128).
* ``flex``: FlexAttention with a document-causal block mask built from the layout once per forward
  (``document_block_mask``: for every 128-token query block, the key blocks it sees, split into
  full blocks and partial ones that evaluate ``doc[q] == doc[k] and q >= k``); compiled on CUDA,
  eager elsewhere (eager materialises the scores: tests only).
"""

from __future__ import annotations

import functools
import inspect

import torch

from model.layers import SeqLayout

FLEX_BLOCK = 128


def varlen_causal_attention(
    q_BTHQ: torch.Tensor,
    k_BTHQ: torch.Tensor,
    v_BTHV: torch.Tensor,
    layout: SeqLayout,
    scale: float,
    form: str,
) -> torch.Tensor:
    """Returns o [B, T, H, Dv] in q's dtype. ``form``: "varlen" or "flex"."""
    B, T, H, _ = q_BTHQ.shape
    V = v_BTHV.shape[-1]
    q_RHQ, k_RHQ, v_RHV = (x.reshape(B * T, H, x.shape[-1]) for x in (q_BTHQ, k_BTHQ, v_BTHV))
    if form == "varlen" and q_RHQ.dtype not in (torch.float16, torch.bfloat16):
        form = "flex"  # flash attention has no fp32 kernel
    if form == "varlen":
        o_RHV = _varlen(q_RHQ, k_RHQ, v_RHV, layout, scale)
    elif form == "flex":
        o_RHV = _flex(q_RHQ, k_RHQ, v_RHV, layout, scale)
    else:
        raise ValueError(f"attention form must be 'varlen' or 'flex', got {form!r}")
    return o_RHV.reshape(B, T, H, V).to(q_BTHQ.dtype)


# ------------------------------------------------------------------------------ varlen flash attention
@torch.compiler.assume_constant_result  # a compiled MLA layer takes the answer as a constant, not tracing inspect
def _varlen_causal_kwargs() -> tuple:
    """torch 2.10/2.11 spell causal ``is_causal=True``; 2.13 ``window_size=(-1, 0)``: (name, value). Read from
    the signature at each eager call (tens of microseconds, four times a step)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return ("is_causal", True) if "is_causal" in params else ("window_size", (-1, 0))


def _varlen(q_RHQ, k_RHQ, v_RHV, layout: SeqLayout, scale: float) -> torch.Tensor:
    return varlen_rows(q_RHQ, k_RHQ, v_RHV, layout.cu_seqlens_N1, layout.max_len, scale)


def varlen_rows(q_RHQ, k_RHQ, v_RHV, cu_N1: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """o [R, H, Dv] of the ``varlen`` form over flattened rows, given the sequences' offsets (int32, device) and
    the longest one's length: tensors and an int, nothing read from the host (a compiled MLA layer calls it)."""
    from torch.nn.attention.varlen import varlen_attn

    Q, V = q_RHQ.shape[-1], v_RHV.shape[-1]
    v_pad = torch.nn.functional.pad(v_RHV, (0, Q - V)) if V < Q else v_RHV
    name, value = _varlen_causal_kwargs()
    o = varlen_attn(q_RHQ, k_RHQ, v_pad, cu_N1, cu_N1, max_len, max_len, scale=scale, **{name: value})
    return o[..., :V]


# ------------------------------------------------------------------------------ FlexAttention
def document_block_mask(layout: SeqLayout, block: int = FLEX_BLOCK):
    """BlockMask of document-causal attention over the flattened R = B * T tokens, from device
    tensors only (no host sync): query block i sees key blocks from the one holding the start of
    its first token's sequence up to i; a key block is full when it lies strictly below i and in
    the same sequence as i's last token (sequences are contiguous, so then every pair is visible)."""
    from torch.nn.attention.flex_attention import BlockMask

    doc_R = layout.seq_BT.reshape(-1).to(torch.int32)
    R, dev = doc_R.numel(), doc_R.device
    nb = (R + block - 1) // block
    doc_pad = torch.cat([doc_R, doc_R.new_full((nb * block - R,), -1)])  # the kernel may read past R
    starts_N = layout.cu_seqlens_N1[:-1].long()
    first = torch.arange(nb, device=dev) * block
    last = torch.clamp(first + block, max=R) - 1
    doc_first, doc_last = doc_R[first].long(), doc_R[last].long()
    lo = starts_N[doc_first] // block
    i, j = torch.arange(nb, device=dev)[:, None], torch.arange(nb, device=dev)[None, :]
    touched = (j >= lo[:, None]) & (j <= i)
    full = (j < i) & (doc_first[None, :] == doc_last[:, None])
    partial = touched & ~full

    def ordered(m):
        num = m.sum(-1).to(torch.int32)[None, None]
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)[
            None, None
        ]
        return num, idx

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_pad[q_idx] == doc_pad[kv_idx]) & (q_idx >= kv_idx)

    (kv_num, kv_idx), (full_num, full_idx) = ordered(partial), ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(R, R))  # fmt: skip


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q_RHQ, k_RHQ, v_RHV, layout: SeqLayout, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    mask = layout.cached(("flex_mask", FLEX_BLOCK), lambda: document_block_mask(layout))
    fn = _compiled_flex() if q_RHQ.is_cuda else flex_attention
    q, k, v = (x.transpose(0, 1)[None] for x in (q_RHQ, k_RHQ, v_RHV))  # [1, H, R, D]
    o_1HRV = fn(q, k, v, block_mask=mask, scale=scale)
    return o_1HRV[0].transpose(0, 1)
