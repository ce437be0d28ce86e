"""Our KDA and gated-MLA layers inside vLLM's paged state, computing with the learner's own modules.

* ``KDAStates`` is a vLLM ``MambaBase`` recurrent-state layer holding the states of one or more KDA layers
  (``rollout.vllm_plugin.kda_state_depth``: fewer KV-cache groups, less of vLLM's per-step bookkeeping), and
  ``KDAStateLayer`` one KDA layer computing on its views. It reuses vLLM's gated-delta-net
  attention metadata (``mamba_type`` GDN_ATTN: decodes first, then prefills, per-request state slots,
  ``has_initial_state``) but computes with ``model.kda.KimiDeltaAttention`` itself (its projections,
  gate, short convs and the ``kernels.kda`` chunked kernel for prefills), so rollout and learner run
  the same code. Decode steps update the states in place by slot with our kernels: the pool step
  ``kernels.kda.kda_decode_step_`` (PyTorch on CPU, the Triton step recurrence on CUDA). Per slot it
  keeps four states: the q, k and v conv states [C, K-1] (the layout of
  ``model.layers.ShortConvolution``) and the fp32 recurrent state [H, K, V].
* Gated MLA through vLLM's paged attention, in one of two cache forms picked by the HF config field
  ``mla_cache_form`` (``rollout.vllm_plugin.MLA_CACHE_FORMS``; set it in config.json or through
  vLLM's ``hf_overrides`` / ``WorkerConfig.mla_cache_form``; an unknown value is a ValueError; unset or
  "auto": latent on CUDA, expanded elsewhere, ``rollout.vllm_plugin.mla_cache_form``):

  - "expanded" (the CPU default; ``MLAPagedAttention``): K = [k_nope_h ; k_pe] and V = v_h per head,
    zero-padded to a CPU paged-attention head size. Zero padding changes no dot product and the
    padded V columns are dropped, so this is the same function as the learner's expanded SDPA. The
    cache holds H * 2 * head_size values per token and layer.
  - "latent" (the CUDA default; ``MLALatentPagedAttention``): the absorbed form as multi-query attention over the
    latent (``GatedMLA._attend_absorbed`` in vLLM's pages): ONE KV head with K = [c_kv ; k_pe] and
    V = c_kv, queries [q_nope_h W_UK_h ; q_pe_h], the model's own softmax scale, then W_UV_h per
    head on the latent output. The cache holds 2 * latent_head_size values per token and layer
    (kv_lora_rank + qk_rope rounded up to a head size: a CPU paged-attention size, on CUDA a multiple of
    32 for vLLM's Triton backend, ``rollout.vllm_plugin.latent_head_size``; stored twice because vLLM's
    paged attention keeps separate K and V pages; on the Triton backend only the K pages are read, decode steps
    on ``kernels.mla``'s split-KV kernel and the others on vLLM's kernel taking the K pages as V:
    ``read_values_from_keys``, the default; ``LONGHORIZON_MLA_VALUES_FROM_KEYS=0`` turns it off): about 2x the
    single-latent cache of vLLM's GPU MLA backends (kv_lora_rank + rope, once), but H times fewer KV
    heads than the expanded form. On CPU the
    latent size must fit a paged-attention head size (at most 512): K3's 512 + 64 = 576 does not and
    is rejected with a ValueError; at that size vLLM's own MLA backends are the route.

  Deviation: vLLM's own MLA backends (their own layer class and weight layout) are not used. On a
  CPU without AMX, vLLM 0.32's CPU MLA backend cannot serve a model that also has recurrent layers:
  for hybrids vLLM raises the attention block size until one attention page holds a recurrent-state
  page (128 tokens and more), while that backend only takes 16-token blocks (and only a 576-wide
  latent head, DeepSeek's). It is also approximate: in fp32, a plain DeepSeek-V3-style MLA model's
  logprobs differed from Hugging Face's by up to 1-2e-2, where plain attention agrees to 5e-7.
  Both forms here run on vLLM's generic paged attention, on CPU and GPU alike, and are tested on
  CPU; on a GPU (vLLM 0.26.0, one H200) both have run, equal to the learner with routes replayed
  (bench/RESULTS.md, "Rollout on the H200"), the latent one 1.3-1.8x faster in decode ("Rollout throughput").
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from kernels.conv import conv_state_steps_
from kernels.kda import kda_decode_step_
from kernels.mla import latent_decode_triton
from model.cache import KDAState
from model.kda import kda_gates
from model.layers import SeqLayout, l2_normalize_qk, seq_layout
from model.serving import fuse_linears, kda_state_dtypes, kda_state_shapes


class StaleStepGuard:
    """Keeps a parked session's recurrent state at its turn's end when the scheduler runs one step too far.

    vLLM's async scheduler plans step N+1 before step N's tokens are known, so a turn that ends on a stop
    token at step N runs one more decode step, whose input is that stop token. The scheduler then rolls its
    token count back to the turn's end (the stop token counts as not computed, and the next turn's chunk
    starts with it), and the attention layers' KV at that position is simply written again by the next
    chunk; a recurrent state cannot be rolled back. So the KDA layers step such a token with a padding slot
    (vLLM's PAD_SLOT_ID, -1: no state is read or written, the output is zero and is never used: the step's
    sampled token is discarded).

    ``ids_S`` (fixed address, -1 padded) holds the ids that end every turn the engine runs (the worker sets
    them, ``set_ids``, and sends only requests that stop on each of them); ``mark`` flags the step's tokens
    whose input is one of them, and ``decode_slots`` pads the slots of the flagged decode tokens (vLLM puts
    a step's decodes first). A prompt token is never flagged: vLLM counts a one-token chunk of a prompt that
    continues a state as a decode ("short extend"; the next turn's chunk starting with the stop token is
    longer, but a long prompt's last chunk can be one token), so the step's metadata builder
    (``KDAMetadataBuilder``) marks the decode rows still prefilling in ``prompt_R`` (fixed address too, written
    only when a step has one), and those are stepped as they are. Device ops only, so a captured decode graph
    does the same."""

    def __init__(self, capacity: int, max_decodes: int, device: torch.device | str) -> None:
        self.ids_S = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.prompt_R = torch.zeros(max_decodes, dtype=torch.bool, device=device)
        self._prompt_rows = False  # whether prompt_R holds a True now
        self.stale_T: torch.Tensor | None = None

    def set_ids(self, ids: list[int]) -> None:
        ids = sorted(set(int(i) for i in ids))
        if len(ids) > self.ids_S.numel() or any(i < 0 for i in ids):
            raise ValueError(f"turn-end ids must be at most {self.ids_S.numel()} non-negative ids, got {ids}")
        self.ids_S.fill_(-1)
        if ids:
            self.ids_S[: len(ids)].copy_(torch.tensor(ids, dtype=torch.long))

    def mark(self, input_ids_T: torch.Tensor | None) -> None:
        """Flag the step's tokens whose input is a turn-end id, less the decode rows that are prompt tokens
        (``prompt_R``, which the step's metadata builder sets before the forward): once a step, for every KDA
        layer's ``decode_slots``."""
        if input_ids_T is None:
            self.stale_T = None
            return
        stale_T = (input_ids_T[:, None] == self.ids_S[None, :]).any(-1)
        rows = min(stale_T.shape[0], self.prompt_R.shape[0])
        stale_T[:rows] &= ~self.prompt_R[:rows]
        self.stale_T = stale_T

    def set_prompt_decodes(self, prefilling_R: torch.Tensor | None) -> None:
        """The step's decode rows that are prompt tokens (vLLM's ``is_prefilling`` of its decode requests, on the
        host), or None; a device write only when a row is one, or the last step had one."""
        rows = prefilling_R is not None and bool(prefilling_R.any())
        if rows:
            if prefilling_R.numel() > self.prompt_R.numel():
                raise ValueError(f"{prefilling_R.numel()} decode rows, room for {self.prompt_R.numel()}")
            self.prompt_R.zero_()
            self.prompt_R[: prefilling_R.numel()].copy_(prefilling_R.to(torch.bool))
        elif self._prompt_rows:
            self.prompt_R.zero_()
        self._prompt_rows = rows

    def decode_slots(self, slots_N: torch.Tensor) -> torch.Tensor:
        """``slots_N`` with the flagged decode rows' slots -1: one kernel a layer."""
        if self.stale_T is None:
            return slots_N
        return torch.where(self.stale_T[: slots_N.shape[0]], -1, slots_N)


class KDAMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's gated-delta-net metadata with the step's token offsets on the host attached (``_lh_query_start_cpu``,
    vLLM's own host copy, when no request is a speculative decode: the KDA layers' prefill layout is then built
    without reading the device, ``_prefill_layout``), and the step's prompt rows among its decodes handed to the
    KDA layers' stale-step guard (``StaleStepGuard.set_prompt_decodes``; nothing when the model has none)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layer = vllm_config.compilation_config.static_forward_context.get(layer_names[0])
        self.stale_step_guard: StaleStepGuard | None = getattr(layer, "stale_step_guard", None)

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        meta = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        host = getattr(common_attn_metadata, "query_start_loc_cpu", None)
        if meta.num_prefills > 0 and not getattr(meta, "num_spec_decodes", 0) and host is not None:
            with contextlib.suppress(AttributeError, TypeError):  # a metadata type that takes no new attributes
                meta._lh_query_start_cpu = host
        if self.stale_step_guard is not None:
            prefilling = getattr(common_attn_metadata, "is_prefilling", None)
            self.stale_step_guard.set_prompt_decodes(None if prefilling is None else prefilling[: meta.num_decodes])
        return meta


class KDAAttentionBackend(GDNAttentionBackend):
    """vLLM's gated-delta-net backend with ``KDAMetadataBuilder``."""

    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return KDAMetadataBuilder


def kda_state_copy_funcs():
    """Align-mode prefix caching copies whole per-slot states; all four are copied verbatim."""
    return (get_temporal_copy_spec,) * 4


class KDAStates(nn.Module, MambaBase):
    """The recurrent states of ``depth`` KDA layers as one vLLM state layer: each sequence's slot holds all of
    them ([depth, ...] per state; ``model.serving.kda_state_shapes``), and each layer computes on its own views
    (``layer_states``). vLLM registers, sizes, binds and schedules this object; the layers
    (``KDAStateLayer``) read its attention metadata under its name. depth 1 is one KDA layer's states as they
    were; a larger depth makes fewer KV-cache groups (``rollout.vllm_plugin.kda_state_depth``)."""

    def __init__(self, config, depth: int, prefix: str) -> None:
        super().__init__()
        self.config, self.depth, self.prefix = config, depth, prefix
        # set by the model when sessions run async; the metadata builder hands it the step's prompt rows and the
        # stack's layers pad their stale decode slots with it
        self.stale_step_guard: StaleStepGuard | None = None
        vllm_config = get_current_vllm_config()
        self.model_dtype = vllm_config.model_config.dtype
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix}")
        ctx[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    # --- MambaBase contract ---------------------------------------------------------------------------
    def get_state_shape(self):
        return kda_state_shapes(self.config, self.depth)

    def get_state_dtype(self):
        return kda_state_dtypes(self.model_dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_attn_backend(self):
        return KDAAttentionBackend

    def layer_states(self, index: int) -> tuple[torch.Tensor, ...]:
        """The q, k, v conv states and the recurrent state of the ``index``-th layer of the stack: views of vLLM's
        state tensors [slots, ...] (made per call: a captured decode graph makes them once)."""
        if self.depth == 1:
            return self.kv_cache
        return tuple(t[:, index] for t in self.kv_cache)


class KDAStateLayer(nn.Module):
    """One KDA layer in vLLM: state slots in vLLM's pages (``states``, its ``index``-th layer), math in the learner's
    KDA module."""

    def __init__(self, kda: nn.Module, states: KDAStates, index: int = 0) -> None:
        super().__init__()
        self._kda = [kda]  # a plain reference: the parameters stay registered under the HF module tree
        self._states, self.index = [states], index  # a list: the stack is registered once, by the model
        self.decode_inputs_fn = kda_decode_inputs  # ``rollout.vllm_model`` may swap in a compiled one
        self.w_in, self.in_sizes = fuse_input_projections(kda)
        self.prefix = states.prefix  # the name vLLM keys the step's attention metadata by

    @property
    def kv_cache(self) -> tuple[torch.Tensor, ...]:
        return self._states[0].layer_states(self.index)

    # --- forward --------------------------------------------------------------------------------------
    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None or meta.num_actual_tokens == 0:
            return torch.zeros_like(x_TD)  # profiling / dummy run: the output is not used
        # vLLM's int32 slot ids as they are: the decode kernels read either width (one conversion fewer per
        # layer and step); the prefill indexes the pool with them, as int64
        slots = meta.non_spec_state_indices_tensor
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        if meta.num_prefills == 0 and ndt == x_TD.shape[0]:  # a decode step (a captured graph's): no copies
            return self._decode(x_TD, slots[:nd])
        y_TD = torch.zeros_like(x_TD)
        if nd > 0:
            y_TD[:ndt] = self._decode(x_TD[:ndt], slots[:nd])
        if meta.num_prefills > 0:
            npf, npt = meta.num_prefills, meta.num_prefill_tokens
            cu, layout = _prefill_layout(meta, nd, ndt, npf, npt, x_TD.device)
            has_init = meta.prefill_has_initial_state[:npf]
            y_TD[ndt : ndt + npt] = self._run(
                x_TD[None, ndt : ndt + npt], slots[nd : nd + npf].long(), cu, has_init, layout
            )[0]
        return y_TD

    def _run(self, x_BTD, slots_N, cu_seqlens, has_init_N, layout: SeqLayout | None = None) -> torch.Tensor:
        """One call of the learner's KDA over N sequences whose states live in ``slots_N`` (``layout``: the
        step's, shared by the layers; built here when not given)."""
        conv_q, conv_k, conv_v, rec = self.kv_cache
        state = KDAState(rec[slots_N], conv_q[slots_N], conv_k[slots_N], conv_v[slots_N])
        if has_init_N is not None:  # a fresh sequence starts from zero state, not from a recycled slot
            fresh_N = ~has_init_N.to(torch.bool)  # masked on the device: no host read of the flags; negated once
            for t in (state.recurrent_NHKV, state.conv_q_NCW, state.conv_k_NCW, state.conv_v_NCW):
                t.masked_fill_(fresh_N.view(-1, *[1] * (t.ndim - 1)), 0)
        B, T, _ = x_BTD.shape
        if layout is None:
            layout = seq_layout(B, T, cu_seqlens, x_BTD.device)
        y_BTD, new = self._kda[0](x_BTD, layout, cu_seqlens=cu_seqlens, state=state, return_state=True)
        rec[slots_N] = new.recurrent_NHKV.to(rec.dtype)
        conv_q[slots_N] = new.conv_q_NCW.to(conv_q.dtype)
        conv_k[slots_N] = new.conv_k_NCW.to(conv_k.dtype)
        conv_v[slots_N] = new.conv_v_NCW.to(conv_v.dtype)
        return y_BTD

    def _decode(self, x_ND: torch.Tensor, slots_N: torch.Tensor) -> torch.Tensor:
        """One token per sequence, states updated in place: the learner's projections, the three conv
        window steps in vLLM's state slots (``kernels.conv.conv_state_steps_``: one Triton launch for the three on
        CUDA, no gathers or scatters, padding slots skipped), then the q/k norms and gates as one function,
        ``kda_decode_inputs`` (one compiled region when the engine compiles, ``rollout.vllm_model``), our
        in-place pool step for the delta rule, and the learner's gated output (tests hold this path to the
        learner's full-sequence logprobs)."""
        kda = self._kda[0]
        conv_q, conv_k, conv_v, rec = self.kv_cache
        guard = self._states[0].stale_step_guard
        if guard is not None:
            slots_N = guard.decode_slots(slots_N)
        xq, xk, xv, fa, b, gate = self._input_projections(x_ND)
        silu = kda.q_conv1d.activation == "silu"
        ws = [conv.weight[:, 0] for conv in (kda.q_conv1d, kda.k_conv1d, kda.v_conv1d)]
        q, k, v = conv_state_steps_((xq, xk, xv), (conv_q, conv_k, conv_v), slots_N, ws, silu)
        q, k, v, g, beta = self.decode_inputs_fn(
            q, k, v, kda.f_b_proj(fa), b, kda.dt_bias, kda.A_log, kda.gate_kind, kda.lower_bound
        )
        # o in the residual stream's dtype, which the gate casts it to first: the prefill's dtype, one compiled gate
        o_NHV = kda_pool_step_(q, k, v, g, beta, rec, slots_N, kda.head_dim**-0.5, x_ND.dtype)
        if not kda.full_rank_gate:
            gate = kda.g_b_proj(gate)
        # as a batch of one row and a contiguous gate, what the prefill passes: one compiled output gate for
        # both (a rank-3 call compiled it a second time, 1.6 s of an H200 start; a full-rank gate is a strided
        # slice of the fused projection)
        return kda.gated_output(o_NHV[None], x_ND[None], gate.contiguous()[None])[0]

    def _input_projections(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v, f_a, b and the output gate's first projection of x: one GEMM over the fused weight, or
        six calls of the modules when they could not be fused (``fuse_input_projections``)."""
        kda = self._kda[0]
        if self.w_in is not None:
            return F.linear(x_ND, self.w_in).split(self.in_sizes, dim=-1)
        return tuple(m(x_ND) for m in _input_linears(kda))


def _prefill_layout(meta, nd: int, ndt: int, npf: int, npt: int, device) -> tuple[torch.Tensor, SeqLayout]:
    """The step's prefill offsets and their sequence layout, built once per attention-metadata object: every
    KDA layer of a cache group gets the same one from vLLM, and the KDA kernel's chunk plan, cached on the layout,
    once too. The layout's host bounds come from vLLM's host copy of the offsets (``KDAMetadataBuilder``), so a
    prefill step reads nothing back from the device; without it (speculative decodes, another builder) they are
    read back once per group and step."""
    cached = getattr(meta, "_lh_prefill_layout", None)
    if cached is None or cached[0] != (nd, ndt, npf, npt):
        cu = (meta.non_spec_query_start_loc[nd : nd + npf + 1] - ndt).long()
        host = getattr(meta, "_lh_query_start_cpu", None)
        offsets = cu if host is None else (host[nd : nd + npf + 1] - ndt).long()
        cached = ((nd, ndt, npf, npt), cu, seq_layout(1, npt, offsets, device))
        # a metadata type that takes no new attributes: the layout is built per layer, as before
        with contextlib.suppress(AttributeError, TypeError):
            meta._lh_prefill_layout = cached
    return cached[1], cached[2]


def _input_linears(kda: nn.Module) -> list[nn.Module]:
    return [kda.q_proj, kda.k_proj, kda.v_proj, kda.f_a_proj, kda.b_proj,
            kda.g_proj if kda.full_rank_gate else kda.g_a_proj]  # fmt: skip


def fuse_input_projections(kda: nn.Module) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """(fused weight, output sizes) of the six projections a KDA decode step applies to x (``fuse_linears``): a
    decode step pays one GEMM instead of six."""
    return fuse_linears(_input_linears(kda))


def kda_decode_inputs(
    q_NC, k_NC, v_NC, zf_NX, b_NH, dt_bias_X, A_log_H, gate_kind: str, lower_bound: float,
):  # fmt: skip
    """The element-wise work of one KDA decode step after the short convolutions, a function of tensors and
    constants: the q/k L2 norms and the gates. Returns (q, k, v [N, H, D] fp32, g [N, H, D] fp32, beta [N, H]
    fp32); the kernels' conventions are the learner's: unscaled L2-normed q (scale passed), log-space gate g."""
    H = A_log_H.shape[0]
    N = q_NC.shape[0]
    q_NHK, k_NHK = l2_normalize_qk(q_NC.view(N, H, -1), k_NC.view(N, H, -1))
    g_NHK, beta_NH = kda_gates(zf_NX, b_NH, dt_bias_X, A_log_H, gate_kind, lower_bound)
    return q_NHK.float(), k_NHK.float(), v_NC.view(N, H, -1).float(), g_NHK, beta_NH


@torch.no_grad()
def kda_pool_step_(
    q_NHK, k_NHK, v_NHV, g_NHK, beta_NH, pool_PHKV, slots_N, scale: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One KDA decode step for N sequences whose states live in ``pool_PHKV`` at ``slots_N``, in place:
    ``kernels.kda.kda_decode_step_`` (PyTorch on CPU, the Triton step kernel on CUDA, stepping vLLM's
    strided state views in place)."""
    return kda_decode_step_(q_NHK, k_NHK, v_NHV, g_NHK, beta_NH, pool_PHKV, slots_N, scale=scale, out_dtype=out_dtype)


class _PagedMLA(nn.Module):
    """What both cache forms share: the model's MLA module (in a list, so it is not registered here a
    second time), vLLM's paged ``Attention`` over ``num_kv_heads`` heads of ``head_size`` with the
    model's scale, and the zero padding of q, k, v up to that head size."""

    def __init__(self, mla: nn.Module, head_size: int, num_kv_heads: int, cache_config, prefix: str) -> None:
        super().__init__()
        self._mla = [mla]
        self.num_heads, self.head_size = mla.num_heads, head_size
        self.attn = Attention(
            num_heads=mla.num_heads,
            head_size=head_size,
            scale=mla.scale,
            num_kv_heads=num_kv_heads,
            cache_config=cache_config,
            prefix=f"{prefix}.attn",
        )

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """t zero-padded to the head size; t itself when it has that size (``F.pad`` by nothing copies)."""
        extra = self.head_size - t.shape[-1]
        return F.pad(t, (0, extra)) if extra else t


class MLAPagedAttention(_PagedMLA):
    """Gated MLA with its K/V expanded per head into vLLM's paged KV cache."""

    def __init__(self, mla: nn.Module, head_size: int, cache_config, prefix: str) -> None:
        super().__init__(mla, head_size, mla.num_heads, cache_config, prefix)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        mla = self._mla[0]
        x_1TD = x_TD[None]
        q_nope, q_pe = mla._queries(x_1TD)
        c_kv, k_pe = mla._latents(x_1TD)
        k_nope, v = mla._expand_kv(c_kv)
        T, H = x_TD.shape[0], self.num_heads
        q_THQ = torch.cat([q_nope, q_pe], dim=-1)[0]
        k_THQ = torch.cat([k_nope, k_pe[:, :, None, :].expand(1, T, H, mla.rope)], dim=-1)[0]
        out = self.attn(
            self._pad(q_THQ).reshape(T, -1), self._pad(k_THQ).reshape(T, -1), self._pad(v[0]).reshape(T, -1)
        )
        attn_THV = out.view(T, H, self.head_size)[..., : mla.v_dim]
        return mla._output(x_1TD, attn_THV[None])[0]


class MLALatentPagedAttention(_PagedMLA):
    """Gated MLA in the absorbed form: multi-query attention over one latent KV head in vLLM's pages.

    Cache per token and layer: 2 * head_size values (K = [c_kv ; k_pe], V = c_kv, both padded),
    against H * 2 * expanded head size for ``MLAPagedAttention`` and kv_lora_rank + qk_rope (one copy)
    for vLLM's GPU MLA backends. W_UK / W_UV are read from kv_b_proj on every call, so in-place
    weight updates (and LoRA folds) take effect with no cached copy to refresh."""

    def __init__(self, mla: nn.Module, head_size: int, cache_config, prefix: str) -> None:
        latent_dim = mla.kv_lora_rank + mla.rope
        if head_size < latent_dim:
            raise ValueError(f"latent head size {head_size} < kv_lora_rank + qk_rope = {latent_dim}")
        # one KV head; the expanded form's scale, since q_lat . c_kv == q_nope . k_nope exactly
        super().__init__(mla, head_size, 1, cache_config, prefix)
        self.values_from_keys = read_values_from_keys(self.attn, mla.kv_lora_rank, mla.rope)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        mla = self._mla[0]
        x_1TD = x_TD[None]
        q_nope, q_pe = mla._queries(x_1TD)
        c_kv, k_pe = mla._latents(x_1TD)
        w_uk_HNR, w_uv_HVR = mla.absorbed_weights(c_kv)
        T, H, R = x_TD.shape[0], self.num_heads, mla.kv_lora_rank
        q_lat_THR = torch.einsum("thn,hnr->thr", q_nope[0], w_uk_HNR)
        q_THL = torch.cat([q_lat_THR, q_pe[0]], dim=-1)
        k_TL = torch.cat([c_kv[0], k_pe[0]], dim=-1)
        out = self.attn(self._pad(q_THL).reshape(T, -1), self._pad(k_TL), self._pad(c_kv[0]))
        lat_THR = out.view(T, H, self.head_size)[..., :R]  # attention-weighted c_kv per head
        attn_THV = torch.einsum("thr,hvr->thv", lat_THR, w_uv_HVR)
        return mla._output(x_1TD, attn_THV[None])[0]


def read_values_from_keys(attn: nn.Module, rank: int, rope: int) -> bool:
    """The latent form on vLLM's Triton backend (the CUDA default), on by default (``LONGHORIZON_MLA_VALUES_FROM_KEYS``
    at construction: unset or 1 on, 0 vLLM's own kernel as it is, any other value a ValueError):

    * decode-only steps (one query token a sequence) go to ``kernels.mla.latent_decode_triton``: the K pages read
      once, split at ``rank`` (no power-of-two padding of the 320-wide head), V taken from the same tile;
    * every other step stays on vLLM's kernel, handed the K pages as V.

    Both rest on V = c_kv being K's first ``rank`` columns and on only those output columns being used
    (``lat_THR``): the same values, one page a token streamed instead of two (the V pages are still written, never
    read). True when applied: the layer's impl is vLLM's ``TritonAttentionImpl`` itself, not a subclass or another
    backend."""
    impl = getattr(attn, "impl", None)
    if not _values_from_keys_on() or impl is None:
        return False
    try:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    except ImportError:  # a vLLM without the Triton backend
        return False
    if type(impl) is not TritonAttentionImpl:
        return False
    impl.__class__ = values_from_keys_impl(TritonAttentionImpl)
    impl.latent_dims = (rank, rope)
    return True


def _values_from_keys_on() -> bool:
    value = os.environ.get("LONGHORIZON_MLA_VALUES_FROM_KEYS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LONGHORIZON_MLA_VALUES_FROM_KEYS must be 0 or 1 (unset: 1), got {value!r}")
    return value == "1"


@functools.cache
def values_from_keys_impl(impl_cls: type) -> type:
    """``impl_cls`` whose forward hands its module's ``unified_attention`` to ``_latent_attention`` (the module's
    name bound to a wrapper for the call: the impl reads it as a global), restored after it, also on an error. The
    wrapper takes keyword arguments only: a version of the impl that passes the caches by position fails loudly."""
    module = sys.modules[impl_cls.__module__]

    class ValuesFromKeys(impl_cls):
        def forward(self, *args, **kwargs):
            kernel = module.unified_attention
            module.unified_attention = functools.partial(_latent_attention, kernel, *self.latent_dims)
            try:
                return super().forward(*args, **kwargs)
            finally:
                module.unified_attention = kernel

    ValuesFromKeys.__name__ = ValuesFromKeys.__qualname__ = f"ValuesFromKeys{impl_cls.__name__}"
    return ValuesFromKeys


# unified_attention's options the latent decode kernel does not implement, with the values that mean "unused"
_PLAIN_OPTIONS = {
    "alibi_slopes": (None,), "sinks": (None,), "softcap": (None, 0, 0.0), "output_scale": (None,),
    "q_descale": (None,), "qq_bias": (None,), "mm_prefix_range": (None,), "rswa_prefix_lens": (None,),
    "rswa_window": (None,), "chunk_lookback": (None, -1), "k_scale_cache": (None,), "v_scale_cache": (None,),
}  # fmt: skip


def latent_decode_applies(q: torch.Tensor, k: torch.Tensor, max_seqlen_q: int, options: dict) -> bool:
    """Whether a call of vLLM's kernel is one ``kernels.mla.latent_decode_triton`` computes: decode only (for one
    query token, the last of its sequence, causal or not is the same), no window, the cache in the queries' dtype
    (no fp8), no per-token scales, alibi, sinks, soft cap or prefix ranges."""
    window = options.get("window_size")
    quant = options.get("kv_quant_mode")
    return (
        max_seqlen_q == 1 and q.dtype == k.dtype
        and (window is None or tuple(window) == (-1, -1)) and (quant is None or quant.name == "NONE")
        and all(options.get(name) in unused for name, unused in _PLAIN_OPTIONS.items())
    )  # fmt: skip


def _latent_attention(kernel, rank: int, rope: int, *, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                      block_table, softmax_scale, **options):  # fmt: skip
    if latent_decode_applies(q, k, max_seqlen_q, options):
        return latent_decode_triton(q, k, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, rank, rope)
    return kernel(q=q, k=k, v=k, out=out, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, seqused_k=seqused_k,
                  block_table=block_table, softmax_scale=softmax_scale, **options)  # fmt: skip
