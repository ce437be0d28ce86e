"""Gated Multi-head Latent Attention without positional encoding (K3 / Kimi Linear "NoPE MLA").

c_kv = RMSNorm(W_dkv x) (kv_lora_rank), [k_nope; v] = W_ukv c_kv per head, a shared key part
k_pe = W_kr x (qk_rope_head_dim) that is never rotated, q from x (or via q_lora_rank), scale
(qk_nope + qk_rope)^-1/2, causal softmax, then attn_out * sigmoid(W_g x) before W_o.

Two forms of the same function:
* expanded (training, prefill): per-head K/V from kv_b_proj, SDPA per sequence (the reference), or
  every sequence in one varlen call (``model.attention``, picked by ``model.fast`` op "attention");
* absorbed (decode over the latent cache): q_nope is pulled through W_uk into the latent space and
  attends over c_kv with one shared "KV head"; W_uv is applied per head afterwards. Because K3's
  output gate sits between W_uv and W_o, W_uv cannot be folded into W_o (unlike DeepSeek-V2).
The absorbed form reads kv_b_proj's effective weight by applying the module to an identity, so
it stays exact when kv_b_proj is wrapped (e.g. by a LoRA adapter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import fast
from model.attention import varlen_causal_attention
from model.cache import MLAState
from model.config import HybridConfig
from model.layers import RMSNorm, SeqLayout, cast_once, compute_dtype, f32


class GatedMLA(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        H, qk = self.num_heads, self.nope + self.rope
        # the latent norms' eps: rms_norm_eps (K3) unless mla_norm_eps is set (Kimi Linear: 1e-6)
        lat_eps = config.rms_norm_eps if config.mla_norm_eps is None else config.mla_norm_eps
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=lat_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=lat_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)
        self.planned_fn = mla_planned_forward  # scope "blocks" of ``model.compile``: the layer compiled whole

    # ------------------------------------------------------------------ projections
    def _queries(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x_BTD.shape
        q = (
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
            if self.q_lora_rank
            else self.q_proj(x_BTD)
        )
        q_BTHQ = q.view(B, T, self.num_heads, self.nope + self.rope)
        return q_BTHQ[..., : self.nope], q_BTHQ[..., self.nope :]

    def _latents(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ckv = self.kv_a_proj_with_mqa(x_BTD)
        return self.kv_a_layernorm(ckv[..., : self.kv_lora_rank]), ckv[..., self.kv_lora_rank :]

    def _expand_kv(self, c_kv_BSR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = c_kv_BSR.shape
        kv = self.kv_b_proj(c_kv_BSR).view(B, S, self.num_heads, self.nope + self.v_dim)
        return kv[..., : self.nope], kv[..., self.nope :]

    def _output(self, x_BTD: torch.Tensor, attn_BTHV: torch.Tensor) -> torch.Tensor:
        """``x_BTD`` in the compute dtype (``forward``): under autocast the gate product stays bf16, the
        same values as an fp32 product rounded by o_proj's cast (one rounding either way, forward and
        backward), without an fp32 copy of the attention output kept for backward."""
        B, T = x_BTD.shape[:2]
        attn = attn_BTHV.reshape(B, T, self.num_heads * self.v_dim).to(x_BTD.dtype)
        if self.use_output_gate:
            attn = attn * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(attn)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x_BTD: torch.Tensor,
        layout: SeqLayout,
        cu_seqlens: torch.Tensor | None = None,
        state: MLAState | None = None,
        return_state: bool = False,
        absorbed: bool | None = None,
    ) -> tuple[torch.Tensor, MLAState | None]:
        """absorbed=None picks the absorbed form when decoding over a non-empty cache."""
        if state is not None and cu_seqlens is not None:
            raise ValueError("MLA with a cache takes padded [N, T] input, not packed cu_seqlens")
        if state is None and not return_state and not absorbed and self._planned_path(x_BTD):
            return self.planned_fn(self, x_BTD, layout.cu_seqlens_N1, layout.max_len), None
        # one compute-dtype copy of x for the three projections (autocast keeps a copy per nn.Linear)
        xc = cast_once(x_BTD)
        q_nope, q_pe = self._queries(xc())
        c_kv, k_pe = self._latents(xc())
        if state is not None:
            c_kv = torch.cat([state.c_kv_NSR.to(c_kv.dtype), c_kv], dim=1)
            k_pe = torch.cat([state.k_pe_NSP.to(k_pe.dtype), k_pe], dim=1)
        past = 0 if state is None else state.seq_len
        if absorbed is None:
            absorbed = past > 0
        attend = self._attend_absorbed if absorbed else self._attend_expanded
        attn_BTHV = attend(q_nope, q_pe, c_kv, k_pe, layout, past)
        new_state = MLAState(c_kv, k_pe) if return_state else None
        return self._output(xc(), attn_BTHV), new_state

    def _expanded_qkv(self, q_nope, q_pe, c_kv, k_pe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q [B, T, H, Q], k [B, S, H, Q] (the shared rope part broadcast to every head), v [B, S, H, V]."""
        k_nope, v = self._expand_kv(c_kv)
        B, S, H, _ = k_nope.shape
        q_BTHQ = torch.cat([q_nope, q_pe], dim=-1)
        k_BSHQ = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, self.rope)], dim=-1)
        return q_BTHQ, k_BSHQ, v

    def _planned_path(self, x_BTD: torch.Tensor) -> bool:
        """Attention in one ``varlen`` call (``model.fast`` op "attention", half-precision compute: flash
        attention has no fp32 kernel)."""
        dt = compute_dtype(x_BTD)
        return dt in (torch.float16, torch.bfloat16) and fast.pick("attention", x_BTD.device, dt) == "varlen"

    def _attend_expanded(self, q_nope, q_pe, c_kv, k_pe, layout: SeqLayout, past: int) -> torch.Tensor:
        q_BTHQ, k_BSHQ, v = self._expanded_qkv(q_nope, q_pe, c_kv, k_pe)
        form = fast.pick("attention", q_BTHQ.device, q_BTHQ.dtype)
        if past == 0 and form != "loop" and layout.cu_seqlens_N1 is not None:
            return varlen_causal_attention(q_BTHQ, k_BSHQ, v, layout, self.scale, form)
        outs = []
        for b, start, end in layout.bounds:  # one SDPA per sequence: no cross-sequence attention
            q_HTQ = q_BTHQ[b, start:end].transpose(0, 1)
            # with a cache the input is padded (start = 0), so keys run over past + new tokens
            k_HSQ = k_BSHQ[b, start : end + past].transpose(0, 1)
            v_HSV = v[b, start : end + past].transpose(0, 1)
            if past == 0:  # plain causal: lets SDPA pick its fused kernel
                o_HTV = F.scaled_dot_product_attention(q_HTQ, k_HSQ, v_HSV, is_causal=True, scale=self.scale)
            else:
                mask_TS = _causal_mask(end - start, past, q_BTHQ.device)
                o_HTV = F.scaled_dot_product_attention(
                    q_HTQ, k_HSQ, v_HSV, attn_mask=mask_TS, scale=self.scale
                )
            outs.append((b, start, end, o_HTV.transpose(0, 1)))
        return _scatter_rows(outs, (*q_nope.shape[:3], self.v_dim), q_nope)

    def absorbed_weights(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, R] and W_UV [H, v_dim, R] (dtype/device of ``like``): kv_b_proj's effective weight.
        A plain nn.Linear's weight is viewed as it is (no copy: in-place updates show at once, and a decode step
        launches nothing for it); a wrapped one (LoRA) is read by applying the module to an identity, so the
        wrapper stays exact."""
        R, H = self.kv_lora_rank, self.num_heads
        proj = self.kv_b_proj
        if type(proj) is nn.Linear and proj.bias is None:
            w_XR = proj.weight if proj.weight.dtype == like.dtype else proj.weight.to(like.dtype)
        else:
            w_XR = proj(torch.eye(R, device=like.device, dtype=like.dtype)).transpose(0, 1)
        w_HXR = w_XR.reshape(H, self.nope + self.v_dim, R)
        return w_HXR[:, : self.nope], w_HXR[:, self.nope :]

    def _attend_absorbed(self, q_nope, q_pe, c_kv, k_pe, layout: SeqLayout, past: int) -> torch.Tensor:
        w_uk_HNR, w_uv_HVR = self.absorbed_weights(c_kv)
        q_lat_BTHR = torch.einsum("bthn,hnr->bthr", q_nope, w_uk_HNR)
        outs = []
        for b, start, end in layout.bounds:
            kv_end = end + past
            scores_HTS = torch.einsum("thr,sr->hts", q_lat_BTHR[b, start:end], c_kv[b, start:kv_end])
            scores_HTS = scores_HTS + torch.einsum("thp,sp->hts", q_pe[b, start:end], k_pe[b, start:kv_end])
            mask_TS = _causal_mask(end - start, past, c_kv.device)
            scores_HTS = (f32(scores_HTS) * self.scale).masked_fill(~mask_TS, float("-inf"))
            p_HTS = scores_HTS.softmax(-1).to(c_kv.dtype)
            lat_THR = torch.einsum("hts,sr->thr", p_HTS, c_kv[b, start:kv_end])
            outs.append((b, start, end, torch.einsum("thr,hvr->thv", lat_THR, w_uv_HVR)))
        return _scatter_rows(outs, (*q_nope.shape[:3], self.v_dim), q_nope)


def mla_planned_forward(attn: GatedMLA, x_BTD: torch.Tensor, cu_N1: torch.Tensor, max_len: int) -> torch.Tensor:
    """``GatedMLA.forward`` without a cache, attention in one ``varlen`` call given the layout's sequence offsets
    (int32, device) and longest length: nothing reads the host, so ``model.compile`` scope "blocks" compiles the
    whole layer (projections, latent norm, the attention op, output gate) as one graph each way. The same ops as
    the expanded form's varlen path."""
    from model.attention import varlen_rows

    xc = cast_once(x_BTD)
    q_nope, q_pe = attn._queries(xc())
    c_kv, k_pe = attn._latents(xc())
    q_BTHQ, k_BTHQ, v_BTHV = attn._expanded_qkv(q_nope, q_pe, c_kv, k_pe)
    B, T, H, _ = q_BTHQ.shape
    q, k, v = (t.reshape(B * T, H, t.shape[-1]) for t in (q_BTHQ, k_BTHQ, v_BTHV))
    o_BTHV = varlen_rows(q, k, v, cu_N1, max_len, attn.scale).reshape(B, T, H, attn.v_dim).to(q_BTHQ.dtype)
    return attn._output(xc(), o_BTHV)


def _causal_mask(T: int, past: int, device: torch.device) -> torch.Tensor:
    """[T, past + T] boolean, True where query i (at absolute past + i) may see key j."""
    return torch.arange(past + T, device=device)[None, :] <= (past + torch.arange(T, device=device))[:, None]


def _scatter_rows(outs, shape, like: torch.Tensor) -> torch.Tensor:
    if len(outs) == 1 and outs[0][1] == 0 and outs[0][2] == shape[1]:
        return outs[0][3][None]
    rows = [[] for _ in range(shape[0])]
    for b, _start, _end, o in outs:  # bounds come in row-major order, so cat restores the layout
        rows[b].append(o)
    return torch.stack([torch.cat(r, dim=0) for r in rows]).to(like.dtype)
