"""The sparse hybrid causal LM: KDA and gated MLA layers (1-based ``kda_layers`` /
``full_attn_layers``), dense-then-MoE FFNs, Block Attention Residuals, and an LM head.

Module names follow Kimi Linear's HF/vLLM layout (``model.layers.N.self_attn``,
``block_sparse_moe`` for MoE layers, ``mlp`` for dense ones, ``input_layernorm``,
``post_attention_layernorm``, ``model.norm``, ``lm_head``) plus ``attn_res`` / ``mlp_res`` /
``model.out_res`` for the AttnRes pseudo-queries. Single-device math only: no ranks or meshes.

Forward options the RL stack relies on:
* ``cu_seqlens`` (input [1, T]): packed varlen sequences; KDA state, conv state and attention never
  cross a boundary; labels never predict across one.
* ``routed_experts`` [B*T, num_moe_layers, top_k]: replay the rollout's expert choices (R3); a
  token-layer row of -1 is routed freely in the same forward (with ``filler_tokens``, rows for the other
  tokens only: the filler is routed freely); ``output_router_choices=True`` returns the experts used in
  the same layout.
* ``target_ids`` [B, T]: returns ``token_logprobs`` = log p(target_ids[t] | tokens <= t).
* ``past_key_values`` (``HybridCache``) + ``use_cache``: incremental decoding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from model import fast
from model.attnres import AttnResMix, SharedSourceGrads
from model.cache import HybridCache
from model.config import HybridConfig
from model.kda import KimiDeltaAttention
from model.layers import RMSNorm, SeqLayout, ShortConvolution, f32, seq_layout, to_device
from model.lm_head import chunk_logits_grad, chunk_stats, chunked_logprobs_entropy, logits_entropy
from model.mla import GatedMLA
from model.moe import DenseMLP, GroupedExperts, MoEGate, SparseMoE, check_replay_ids, expert_conversions


@dataclass
class HybridCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [B, T, V]
    past_key_values: HybridCache | None = None
    router_choices: torch.Tensor | None = None  # [B*T, num_moe_layers, top_k]
    token_logprobs: torch.Tensor | None = None  # [B, T], fp32
    entropy: torch.Tensor | None = None  # [B, T], fp32: entropy of the next-token distribution at t
    hidden_states: torch.Tensor | None = None  # [B, T, D], final (normed) hidden states


# Flags HF and PEFT wrappers pass to every causal LM; our output object always has the same fields.
_HF_NOOP_KWARGS = frozenset(
    {"return_dict", "output_attentions", "output_hidden_states", "num_items_in_batch"}
)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.self_attn = KimiDeltaAttention(config, layer_idx) if self.is_kda else GatedMLA(config, layer_idx)
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = DenseMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.uses_attn_res:
            # layer 0's attention reads the embedding directly, so it has no attn_res mix
            if layer_idx > 0:
                self.attn_res = AttnResMix(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_res = AttnResMix(config.hidden_size, eps=config.rms_norm_eps)

    def attn_input(self, sources: list[torch.Tensor], shared: SharedSourceGrads | None = None) -> torch.Tensor:
        """The attention's input: ``input_layernorm`` of the AttnRes mix of ``sources`` (of the one source);
        ``shared``: the forward's ``SharedSourceGrads``."""
        return _normed_input(getattr(self, "attn_res", None), self.input_layernorm, sources, shared)

    def ffn_input(self, sources: list[torch.Tensor], shared: SharedSourceGrads | None = None) -> torch.Tensor:
        """The FFN's input: ``post_attention_layernorm`` of the AttnRes mix of ``sources`` (of the one source)."""
        return _normed_input(getattr(self, "mlp_res", None), self.post_attention_layernorm, sources, shared)

    def attention(self, x_BTD, layout, cu_seqlens, state, return_state):
        """``x_BTD``: normed (``attn_input``)."""
        return self.self_attn(x_BTD, layout, cu_seqlens, state, return_state)

    def ffn(self, x_BTD, replay_TK):
        """``x_BTD``: normed (``ffn_input``); ``replay_TK``: validated by HybridModel (once per forward, not per
        layer)."""
        if self.is_moe:
            return self.block_sparse_moe(x_BTD, replay_TK, replay_checked=True)
        return self.mlp(x_BTD), None


def _normed_input(
    mix: AttnResMix | None, norm: RMSNorm, sources: list[torch.Tensor], shared: SharedSourceGrads | None = None
) -> torch.Tensor:
    """``norm(mix(sources))``, the mix and the norm as one region where they can be (``AttnResMix.normed``);
    without a mix (layer 0's attention) the one source normed."""
    if mix is None:
        (x_BTD,) = sources
        return norm(x_BTD)
    return mix.normed(sources, norm, shared)


@contextlib.contextmanager
def _uncounted(model: nn.Module, filler_tokens: int):
    """Every MoE router of ``model`` leaves the last ``filler_tokens`` tokens out of its statistics meanwhile."""
    if filler_tokens < 0:
        raise ValueError(f"filler_tokens must be >= 0, got {filler_tokens}")
    gates = [m for m in model.modules() if isinstance(m, MoEGate)] if filler_tokens else []
    for g in gates:
        g.uncounted_tokens = filler_tokens
    try:
        yield
    finally:
        for g in gates:
            g.uncounted_tokens = 0


@dataclass
class _Step:
    """Per-forward context threaded through the layers."""

    layout: SeqLayout
    cu_seqlens: torch.Tensor | None
    cache: HybridCache | None
    use_cache: bool
    routes: _Routes | None
    choices: list[torch.Tensor]


class _Routes:
    """A forward's replayed routes, checked and moved to the device when the first MoE layer asks for them: the
    layers before it are queued on the device first, so the host's id check and copy of the table ([16K, 15, 8]
    for a gpu_1b micro-batch: a few ms) run while the device computes them instead of before it has any work."""

    def __init__(self, routed: torch.Tensor, num_experts: int, device, ids_checked: bool, free_rows: int = 0) -> None:
        self._routed, self._num_experts, self._device, self._ids_checked = routed, num_experts, device, ids_checked
        self._free_rows = free_rows  # -1 rows appended on the device (a learner's filler tokens)
        self._TMK: torch.Tensor | None = None

    def layer(self, j: int) -> torch.Tensor:
        """[T, top_k] experts of the forward's j-th MoE layer."""
        if self._TMK is None:
            if not self._ids_checked:
                check_replay_ids(self._routed, self._num_experts)
            routed = to_device(self._routed, self._device)  # pinned, no host sync
            if self._free_rows:
                routed = torch.cat([routed, routed.new_full((self._free_rows, *routed.shape[1:]), -1)])
            self._TMK, self._routed = routed.long(), None  # widened on the device
        return self._TMK[:, j]


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    config: HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules: ClassVar[list[str]] = ["HybridDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ShortConvolution):
            init.kaiming_uniform_(module.weight, a=5**0.5)
        elif isinstance(module, AttnResMix):
            init.zeros_(module.query)  # uniform mixing at step 0
        elif isinstance(module, MoEGate):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, GroupedExperts):  # each expert as the nn.Linear projections it stacks
            loaded = getattr(module.gate_up_proj, "_is_hf_initialized", False)  # views carry no flag of their own
            for w in () if loaded else module.expert_weight_views():
                nn.init.normal_(w, mean=0.0, std=std)
        elif isinstance(module, KimiDeltaAttention):
            A_log, dt_bias = module.initial_gate_values()
            init.copy_(module.A_log, A_log)  # init.* skip tensors already loaded from a checkpoint
            init.copy_(module.dt_bias, dt_bias)


class HybridModel(HybridPreTrainedModel):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.uses_attn_res:
            self.out_res = AttnResMix(config.hidden_size, eps=config.rms_norm_eps)
        self.moe_layer_ids = {idx: j for j, idx in enumerate(config.moe_layer_indices)}
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: HybridCache | None = None,
        use_cache: bool = False,
        routed_experts: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        replay_checked: bool = False,
        filler_tokens: int = 0,
        static_layout: bool = False,
    ) -> tuple[torch.Tensor, HybridCache | None, list[torch.Tensor]]:
        """Returns (final normed hidden states [B, T, D], cache or None, experts used per MoE layer).
        ``replay_checked``: the caller checked ``routed_experts``' ids already (a device table checked when
        it was filled): only its shape is checked here, with no host sync. ``filler_tokens``: the last tokens of
        the flattened batch are filler (a learner's padding to a bucket size, its own packed sequence): the MoE
        routers leave them out of their balancing statistics; everything else computes them as any token;
        ``routed_experts`` may leave out their rows (they are routed freely, the -1 rows added on the device).
        ``static_layout``: ``model.layers.seq_layout``'s ``static`` (the same values, shapes fixed by the token and
        sequence counts alone: what a learner replaying its layers as CUDA graphs passes)."""
        with _uncounted(self, filler_tokens):
            return self._forward(input_ids, cu_seqlens, past_key_values, use_cache, routed_experts, inputs_embeds,
                                 replay_checked, static_layout, filler_tokens)  # fmt: skip

    def _forward(self, input_ids, cu_seqlens, past_key_values, use_cache, routed_experts, inputs_embeds,
                 replay_checked, static_layout=False, filler_tokens=0):  # fmt: skip
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x_BTD = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x_BTD.shape
        # the layout is built once per forward, from the host: a CPU cu_seqlens costs no device sync
        layout = seq_layout(B, T, cu_seqlens, x_BTD.device, static=static_layout)
        if cu_seqlens is not None:
            cu_seqlens = layout.cu_seqlens_N1.long()
        if use_cache and past_key_values is None:
            past_key_values = HybridCache.empty(len(self.layers))
        routes = self._routes(routed_experts, B * T, x_BTD.device, replay_checked, filler_tokens)
        step = _Step(layout, cu_seqlens, past_key_values, use_cache, routes, [])
        if self.config.uses_attn_res:
            h_BTD = self._forward_attn_res(x_BTD, step)
        else:
            h_BTD = self._forward_plain(x_BTD, step)
        if past_key_values is not None and use_cache:
            past_key_values.seen_tokens += T
        return h_BTD, past_key_values if use_cache else None, step.choices

    def _routes(
        self, routed: torch.Tensor | None, tokens: int, device, ids_checked: bool = False, filler: int = 0
    ) -> _Routes | None:
        """The shape checked here, the id range once for all layers at the first MoE layer (``_Routes``; on the
        host when given on the CPU). Rows for every token, or for all but the ``filler`` last ones."""
        if routed is None:
            return None
        want = (tokens, len(self.moe_layer_ids), self.config.num_experts_per_token)
        if tuple(routed.shape[1:]) != want[1:] or routed.shape[0] not in (tokens, tokens - filler):
            rows = "B*T" if not filler else f"B*T or B*T - filler_tokens = {tokens - filler}"
            raise ValueError(
                f"routed_experts must be [{rows}, num_moe_layers, top_k] = {list(want)}, got {list(routed.shape)}"
            )
        return _Routes(routed, self.config.num_experts, device, ids_checked, tokens - routed.shape[0])

    def _attn(self, layer: HybridDecoderLayer, x_BTD, step: _Step) -> torch.Tensor:
        i = layer.layer_idx
        state = step.cache.layers[i] if step.cache is not None else None
        y_BTD, new_state = layer.attention(x_BTD, step.layout, step.cu_seqlens, state, step.use_cache)
        if step.use_cache:
            step.cache.layers[i] = new_state
        return y_BTD

    def _ffn(self, layer: HybridDecoderLayer, x_BTD, step: _Step) -> torch.Tensor:
        replay = None
        if layer.is_moe and step.routes is not None:
            replay = step.routes.layer(self.moe_layer_ids[layer.layer_idx])
        y_BTD, experts_TK = layer.ffn(x_BTD, replay)
        if experts_TK is not None:
            step.choices.append(experts_TK)
        return y_BTD

    def _forward_plain(self, h_BTD, step: _Step) -> torch.Tensor:
        """The final normed hidden states, residual wiring (each sub-layer adds to one stream)."""
        for layer in self.layers:
            h_BTD = h_BTD + self._attn(layer, layer.attn_input([h_BTD]), step)
            h_BTD = h_BTD + self._ffn(layer, layer.ffn_input([h_BTD]), step)
        return self.norm(h_BTD)

    def _forward_attn_res(self, emb_BTD, step: _Step) -> torch.Tensor:
        """The final normed hidden states, Block AttnRes wiring (NeMo ``_forward_attn_residual``, FLA
        ``KDABlock.forward``); each sub-layer's mix and norm come as one (``HybridDecoderLayer.attn_input``), the
        gradients of the sources several mixes read summed in one buffer each (``SharedSourceGrads``)."""
        S = self.config.attn_res_block_size
        share = torch.is_grad_enabled() and fast.pick("attn_res_grads", emb_BTD.device) == "shared"
        shared = SharedSourceGrads() if share else None
        blocks: list[torch.Tensor] = []
        partial = emb_BTD  # running sum of the current block (the embedding before layer 0)
        for l, layer in enumerate(self.layers):
            x_BTD = layer.attn_input([*blocks, partial] if blocks else [partial], shared)
            if l % S == 0:  # close the previous block (the embedding at l = 0)
                blocks.append(partial)
                partial = None
            a_BTD = self._attn(layer, x_BTD, step)
            partial = a_BTD if partial is None else partial + a_BTD
            partial = partial + self._ffn(layer, layer.ffn_input([*blocks, partial], shared), step)
        return _normed_input(self.out_res, self.norm, [*blocks, partial], shared)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    """GenerationMixin only makes HF/PEFT treat it as generative; ``generate`` here is our own."""

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig) -> None:
        super().__init__(config)
        self.model = HybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # the chunked head's per-chunk math (``model.lm_head``); ``model.compile`` swaps in compiled ones
        self.head_stats_fn, self.head_grad_fn = chunk_stats, chunk_logits_grad
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: HybridCache | None = None,
        use_cache: bool = False,
        labels: torch.Tensor | None = None,
        target_ids: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        output_router_choices: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        return_logits: bool = True,
        return_entropy: bool = False,
        filler_tokens: int = 0,
        static_layout: bool = False,
        **unused,
    ) -> HybridCausalLMOutput:
        """``labels`` [B, T]: next-token cross-entropy (-100 ignored, no prediction across packed
        boundaries). ``target_ids`` [B, T]: per-token log-probs of the given targets at each position.
        ``logits_to_keep`` > 0 keeps only the last positions' logits (generation).
        ``return_logits=False`` with ``target_ids``: no [B, T, V] logits are kept, not even for
        backward (the LM head is recomputed per chunk, ``model.lm_head``), so long packed batches fit.
        ``return_entropy``: also the entropy of each position's next-token distribution (fp32,
        differentiable), from the chunks when ``return_logits=False``. ``filler_tokens``, ``static_layout``:
        ``HybridModel.forward``'s."""
        unexpected = sorted(k for k, v in unused.items() if v is not None and k not in _HF_NOOP_KWARGS)
        if unexpected:
            raise TypeError(f"HybridForCausalLM.forward got unexpected arguments {unexpected}")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("padding masks are not supported: pack sequences with cu_seqlens instead")
        h_BTD, cache, choices = self.model(
            input_ids, cu_seqlens, past_key_values, use_cache, routed_experts, inputs_embeds,
            filler_tokens=filler_tokens, static_layout=static_layout,
        )  # fmt: skip
        out = HybridCausalLMOutput(past_key_values=cache, hidden_states=h_BTD)
        if not return_logits:
            if target_ids is None or labels is not None:
                raise ValueError("return_logits=False needs target_ids and no labels")
            if type(self.lm_head) is nn.Linear and self.lm_head.bias is None:
                out.token_logprobs, out.entropy = chunked_logprobs_entropy(
                    self.lm_head, h_BTD, target_ids, return_entropy, fns=(self.head_stats_fn, self.head_grad_fn)
                )
            else:  # a wrapped head (an adapter): checkpointed chunks through the module itself
                out.token_logprobs = chunked_token_logprobs(self.lm_head, h_BTD, target_ids)
                if return_entropy:
                    raise ValueError("return_entropy with return_logits=False needs a plain nn.Linear head")
        else:
            kept_BTD = h_BTD[:, -logits_to_keep:] if logits_to_keep else h_BTD
            out.logits = self.lm_head(kept_BTD)
            if labels is not None:
                out.loss = self._next_token_loss(out.logits, labels, cu_seqlens)
            if target_ids is not None:
                out.token_logprobs = token_logprobs(out.logits, target_ids)
            if return_entropy:
                out.entropy = logits_entropy(out.logits)
        if output_router_choices and choices:
            out.router_choices = torch.stack(choices, dim=1)
        return out

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **kwargs) -> dict:
        """HF/PEFT hook: with a cache only the newest token is fed."""
        if past_key_values is not None:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "use_cache": True}

    @staticmethod
    def _next_token_loss(logits, labels, cu_seqlens) -> torch.Tensor:
        targets = labels[:, 1:].clone()
        if cu_seqlens is not None:  # the last token of a sequence does not predict the next sequence
            ends = cu_seqlens[1:-1].long() - 1
            targets[0, ends[ends < targets.shape[1]]] = -100
        return F.cross_entropy(f32(logits[:, :-1].flatten(0, 1)), targets.flatten(), ignore_index=-100)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        **unused,
    ) -> torch.Tensor:
        """Greedy or temperature sampling with the cache; returns [B, T + new] token ids.

        Rows that emit ``eos_token_id`` keep emitting it (the batch stops when every row has).
        """
        attention_mask = unused.pop("attention_mask", None)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("generate takes unpadded prompts of equal length (no padding mask)")
        if unused:
            raise TypeError(f"generate got unsupported arguments {sorted(unused)}")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be positive when sampling, got {temperature}")
        out = self(input_ids, use_cache=True, logits_to_keep=1)
        tokens, finished = (
            [input_ids],
            torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device),
        )
        for _ in range(max_new_tokens):
            logits_BV = f32(out.logits[:, -1])
            if do_sample:
                probs = (logits_BV / temperature).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                nxt = logits_BV.argmax(-1)
            if eos_token_id is not None:
                nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
                finished |= nxt == eos_token_id
            tokens.append(nxt[:, None])
            if eos_token_id is not None and bool(finished.all()):
                break
            out = self(nxt[:, None], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        return torch.cat(tokens, dim=1)


def token_logprobs(logits_BTV: torch.Tensor, target_ids_BT: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log softmax(logits)[target] in fp32, a chunk of positions at a time (bounded memory)."""
    if logits_BTV.shape[:2] != target_ids_BT.shape:
        raise ValueError(
            f"target_ids {tuple(target_ids_BT.shape)} must match logits[:2] {tuple(logits_BTV.shape[:2])}"
        )
    out = []
    for s in range(0, logits_BTV.shape[1], chunk):
        lg = f32(logits_BTV[:, s : s + chunk])
        tgt = target_ids_BT[:, s : s + chunk].long()
        out.append(lg.gather(-1, tgt[..., None])[..., 0] - lg.logsumexp(-1))
    return torch.cat(out, dim=1)


def chunked_token_logprobs(
    lm_head: nn.Module, h_BTD: torch.Tensor, target_ids_BT: torch.Tensor, chunk: int = 1024
) -> torch.Tensor:
    """token_logprobs(lm_head(h), targets) a chunk at a time, each chunk recomputed in backward
    (activation checkpointing), so at most [B, chunk, V] logits exist at once."""
    if h_BTD.shape[:2] != target_ids_BT.shape:
        raise ValueError(
            f"target_ids {tuple(target_ids_BT.shape)} must match hidden states {tuple(h_BTD.shape[:2])}"
        )

    def piece(h, tgt):
        return token_logprobs(lm_head(h), tgt, chunk=chunk)

    out = []
    for s in range(0, h_BTD.shape[1], chunk):
        h, tgt = h_BTD[:, s : s + chunk], target_ids_BT[:, s : s + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            out.append(checkpoint(piece, h, tgt, use_reentrant=False))
        else:
            out.append(piece(h, tgt))
    return torch.cat(out, dim=1)


AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)


def _register_expert_conversions() -> None:
    """Per-expert tensors on disk, stacked experts in the model (``model.moe``): transformers applies the
    mapping in ``from_pretrained`` and reverts it in ``save_pretrained``."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    register_checkpoint_conversion_mapping(HybridConfig.model_type, expert_conversions(), overwrite=True)


_register_expert_conversions()
