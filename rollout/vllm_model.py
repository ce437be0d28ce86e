"""Our hybrid causal LM as a vLLM model (registered by ``rollout.vllm_plugin``).

The module tree *is* the learner's (``model.modeling.HybridModel`` + ``lm_head``), so checkpoint
names map 1:1 and every token-wise part (embeddings, norms, Block AttnRes, MoE router with its
frozen bias, experts, LM head) runs the learner's code. Only the sequence mixers are swapped for
vLLM-aware wrappers (``rollout.vllm_layers``): KDA keeps its state in vLLM's recurrent-state pages (one
state layer per KDA layer, or per stack of ``kda_state_depth`` layers: ``rollout.vllm_plugin.kda_state_depth``,
``WorkerConfig.kda_state_depth``), gated MLA attends over vLLM's paged KV cache in the form the HF config's ``mla_cache_form`` names:
"expanded" per-head K/V or the "latent" one-head absorbed form (``hf_overrides={"mla_cache_form": ...}``,
or ``WorkerConfig.mla_cache_form``); unset or "auto": latent on CUDA, expanded on a CPU.

Deviations from a stock vLLM model, on purpose:
* plain ``torch.nn`` layers instead of vLLM's parallel linears: single-rank only (tensor parallel
  = 1), but no CPU weight repacking, so in-place weight updates are plain ``copy_`` and an updated
  engine equals a fresh one on the same weights;
* MoE experts chosen per token are written by each forward into a buffer of fixed address
  (``routed_experts_TLK``: the step's tokens in its first rows), for every token computed (prefill
  and decode alike), for routing replay; ``rollout.engine_hooks`` maps them to requests and positions.
  A copy into a persistent buffer, not a new tensor per forward, because a replayed CUDA graph runs no
  Python: the copy is part of the graph and refreshes the rows on every replay.
* With ``LONGHORIZON_ROUTE_TABLE=1`` at construction (checks only, off by default) every forward also
  routes its tokens by position from a device table of fixed address (``route_table_PLK``, [max_model_len,
  num MoE layers, top_k], -1 = route freely, the default): a recorded engine's experts for one request,
  replayed in this one. A gather inside the forward, so captured decode graphs take the routes too (a
  Python hook would not run on a replay). ``set_route_table`` fills it.
* With ``stale_step_guard`` in the HF config (``WorkerConfig.async_sessions`` sets it through ``hf_overrides``)
  every forward flags the decode tokens whose input ends a turn, and the KDA layers step them with no state
  (``rollout.vllm_layers.StaleStepGuard``: the async scheduler's step past a turn's stop token).
* vLLM's own torch.compile does not trace this model (it is not a ``support_torch_compile`` model: the
  learner's modules, the paged mixers' metadata reads). With ``enforce_eager=False`` the engine instead
  compiles the learner's element-wise regions (``model.compile``: norms, AttnRes mixes, GLUs, routing,
  the KDA layers' gates and gated output) and the KDA decode step's (``kda_decode_inputs``), and vLLM
  captures CUDA graphs of the whole forward over them. Each region compiles on its first call of a new
  signature, so every capture size runs once uncaptured before its graph is recorded
  (``cudagraph_num_of_warmups`` >= 1). ``enforce_eager=True`` is the reference: no compile, no graphs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from model.compile import compile_regions, resolve_compile_scope
from model.config import HybridConfig
from model.kernel_warmup import start_kda_warmup
from model.modeling import HybridModel
from model.moe import check_replay_ids, stack_expert_weights
from model.serving import inductor_compile_threads, kda_state_dtypes, kda_state_shapes, prepare_for_serving
from rollout.vllm_layers import (
    KDAStateLayer,
    KDAStates,
    MLALatentPagedAttention,
    MLAPagedAttention,
    StaleStepGuard,
    kda_decode_inputs,
    kda_state_copy_funcs,
)
from rollout.vllm_plugin import kda_state_depth, mla_cache_form, mla_kv_layout

TURN_END_IDS = 16
"""Room for the ids that end a turn (a renderer's stop ids and the model's EOS ids)."""


def routes_at(table_PLK: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    """[T, L, K]: the table's rows at ``positions_T``; -1 (route freely) for a position outside the table
    (a padded token, or one past the recorded ones). Device ops only: safe inside a captured graph."""
    P = table_PLK.shape[0]
    if P == 0:
        return table_PLK.new_full((positions_T.shape[0], *table_PLK.shape[1:]), -1)
    positions_T = positions_T.long()
    inside_T = (positions_T >= 0) & (positions_T < P)
    rows_TLK = table_PLK[positions_T.clamp(0, P - 1)]
    return torch.where(inside_T[:, None, None], rows_TLK, torch.full_like(rows_TLK, -1))


class _PagedHybridModel(HybridModel):
    """The learner's decoder stack with the sequence mixers routed through vLLM's caches."""

    paged_mixers: list[nn.Module]

    def _attn(self, layer, x_BTD: torch.Tensor, step) -> torch.Tensor:
        if x_BTD.shape[0] != 1:
            raise ValueError(f"vLLM passes flattened tokens; got a batch of {x_BTD.shape[0]} rows")
        return self.paged_mixers[layer.layer_idx](x_BTD[0])[None]  # x normed (``HybridDecoderLayer.attn_input``)


class VllmHybridForCausalLM(nn.Module, HasInnerState, IsHybrid):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: HybridConfig = vllm_config.model_config.hf_config
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("the longhorizon vLLM model runs with tensor_parallel_size = 1 only")
        self.config = config
        # on a GPU the KDA prefill's Triton kernels compile in a child process started once the weights are in
        # (``_start_kernel_warmup``), while this one compiles its regions and captures its graphs
        # (``model.kernel_warmup``; LONGHORIZON_KERNEL_WARMUP=0 turns it off)
        self._warmup_spec = (config, vllm_config.model_config.dtype, vllm_config.device_config.device)
        self.kernel_warmup = None
        self.model = _PagedHybridModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the layout the plugin's arch convertor reported to vLLM (block sizing) is the one we build
        mla_cls = MLALatentPagedAttention if mla_cache_form(config) == "latent" else MLAPagedAttention
        head_size = mla_kv_layout(config)[1]
        mixers, states = [], []
        depth = kda_state_depth(config)
        for i, layer in enumerate(self.model.layers):
            name = f"{prefix + '.' if prefix else ''}model.layers.{i}.self_attn"
            if layer.is_kda:
                kda_index = sum(isinstance(m, KDAStateLayer) for m in mixers)
                if kda_index % depth == 0:  # a stack's states are named after its first layer (vLLM wants an index)
                    states.append(KDAStates(config, depth, prefix=name))
                mixers.append(KDAStateLayer(layer.self_attn, states[-1], kda_index % depth))
            else:
                mixers.append(mla_cls(layer.self_attn, head_size, vllm_config.cache_config, prefix=name))
        self.paged_mixers = nn.ModuleList(mixers)
        self.model.paged_mixers = list(mixers)  # plain list: registered once, under paged_mixers
        self.kda_states = nn.ModuleList(states)
        # inference only: MoE routing statistics (balancer input) are a training-time thing, and the
        # router bias stays frozen at the checkpoint's value
        rows = vllm_config.scheduler_config.max_num_batched_tokens
        prepare_for_serving(self, rows)
        moe_layers, k = len(config.moe_layer_indices), config.num_experts_per_token
        device = self.lm_head.weight.device
        self._routed_TLK = torch.zeros(rows, moe_layers, k, dtype=torch.int16, device=device) if moe_layers else None
        self.route_table_PLK: torch.Tensor | None = None
        if os.environ.get("LONGHORIZON_ROUTE_TABLE", "0") == "1" and moe_layers:
            P = vllm_config.model_config.max_model_len
            self.route_table_PLK = torch.full((P, moe_layers, k), -1, dtype=torch.long, device=device)
        self.stale_step_guard = None
        if getattr(config, "stale_step_guard", False):  # sessions under the async scheduler (the worker sets it)
            self.stale_step_guard = StaleStepGuard(TURN_END_IDS, rows, device)  # rows: any decode batch, padded too
            for stack in states:
                stack.stale_step_guard = self.stale_step_guard
        self.compiled_regions = [] if vllm_config.model_config.enforce_eager else self._compile(vllm_config)

    def _compile(self, vllm_config: VllmConfig) -> list:
        """The compiled element-wise regions, and a warm-up run before each CUDA graph capture (a region
        compiled while a graph is being captured would break the capture). ``LONGHORIZON_COMPILE_BACKEND``:
        the dynamo backend (default inductor; tests take aot_eager: no C++ builds), or none (CUDA graphs of
        the uncompiled model). ``LONGHORIZON_COMPILE_SCOPE``: ``model.compile``'s scope (default auto: moe on a
        GPU, each MoE block compiled whole, one graph with its routing, permutation and projections; regions
        on CPU). ``LONGHORIZON_COMPILE_THREADS``: inductor's compile workers (``inductor_compile_threads``: 8 on a GPU)."""
        backend = os.environ.get("LONGHORIZON_COMPILE_BACKEND", "inductor")
        if backend == "none":
            return []
        device = self.lm_head.weight.device
        inductor_compile_threads(os.environ.get("LONGHORIZON_COMPILE_THREADS"), device.type == "cuda")
        # inductor keeps eager's bf16 roundings between the ops it fuses: the fast path computes what the
        # eager reference does, up to the order of reductions (an H200 run without it changed greedy tokens)
        options = {"emulate_precision_casts": True} if backend == "inductor" else None
        extra = ((KDAStateLayer, "decode_inputs_fn", kda_decode_inputs),)
        scope = resolve_compile_scope(os.environ.get("LONGHORIZON_COMPILE_SCOPE", "auto"), device, "moe")
        regions = compile_regions(self, backend, extra, options, scope)
        cc = vllm_config.compilation_config
        cc.cudagraph_num_of_warmups = max(1, cc.cudagraph_num_of_warmups)
        return regions

    # --- vLLM model interface -------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if self.stale_step_guard is not None:
            self.stale_step_guard.mark(input_ids)
        routed = None if self.route_table_PLK is None else routes_at(self.route_table_PLK, positions)
        if inputs_embeds is not None:
            h_1TD, _, choices = self.model(inputs_embeds=inputs_embeds[None], routed_experts=routed, replay_checked=True)
        else:
            h_1TD, _, choices = self.model(input_ids[None], routed_experts=routed, replay_checked=True)
        if choices:
            self._record_routes(torch.stack(choices, dim=1))
        return h_1TD[0]

    def _record_routes(self, routed_TLK: torch.Tensor) -> None:
        tokens = routed_TLK.shape[0]
        if tokens > self._routed_TLK.shape[0]:  # more tokens than the scheduler's step budget: eager runs only
            self._routed_TLK = self._routed_TLK.new_zeros(tokens, *self._routed_TLK.shape[1:])
        self._routed_TLK[:tokens].copy_(routed_TLK)

    def set_turn_end_ids(self, ids: list[int]) -> None:
        """The ids that end every turn this engine runs (``rollout.vllm_layers.StaleStepGuard``)."""
        if self.stale_step_guard is None:
            raise RuntimeError("this engine has no stale-step guard: construct it with hf_overrides "
                               "{'stale_step_guard': True}")  # fmt: skip
        self.stale_step_guard.set_ids(ids)

    def set_route_table(self, table_PLK: torch.Tensor | None) -> None:
        """Route position p of the next requests (one at a time) with ``table_PLK[p]`` ([P, num MoE layers,
        top_k] expert ids, -1 rows route freely; positions past P route freely); None clears the table.
        Checked here, on the host, so the forward never syncs on it."""
        if self.route_table_PLK is None:
            raise RuntimeError("this engine has no route table: construct it with LONGHORIZON_ROUTE_TABLE=1")
        self.route_table_PLK.fill_(-1)
        if table_PLK is None:
            return
        table_PLK = torch.as_tensor(table_PLK).long().cpu()
        cap, L, K = self.route_table_PLK.shape
        if table_PLK.ndim != 3 or tuple(table_PLK.shape[1:]) != (L, K) or table_PLK.shape[0] > cap:
            raise ValueError(f"route table must be [P <= {cap}, {L}, {K}], got {tuple(table_PLK.shape)}")
        check_replay_ids(table_PLK.reshape(-1, K), self.config.num_experts)
        self.route_table_PLK[: table_PLK.shape[0]].copy_(table_PLK)

    @property
    def routed_experts_TLK(self) -> torch.Tensor | None:
        """[rows, num MoE layers, top_k] int16: row t holds the experts of the last step's token t (rows past
        the step's token count are stale); None for a model without MoE layers."""
        return self._routed_TLK

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in place (also used for weight updates from the learner).

        Every name and shape is checked before anything is copied, so a bad update leaves the
        running weights untouched. Per-expert tensors (``save_pretrained``'s layout on disk) are stacked
        into the model's two expert weights per layer first (``model.moe.stack_expert_weights``)."""
        targets = dict(self.named_parameters())
        targets.update(dict(self.named_buffers()))
        items = []
        for name, tensor in stack_expert_weights(weights, self.config.num_experts):
            tied_head = name == "lm_head.weight" and self.config.tie_word_embeddings and name not in targets
            if tied_head:  # the learner's tied head is the embedding, which is loaded under its own name
                name = "model.embed_tokens.weight"
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} has no counterpart in the vLLM model")
            if tuple(targets[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(targets[name].shape)}"
                )
            if not tied_head:
                items.append((name, tensor))
        with torch.no_grad():
            for name, tensor in items:
                dst = targets[name]
                dst.copy_(tensor.to(dtype=dst.dtype, device=dst.device))
        loaded = {name for name, _ in items}
        # paged-attention bookkeeping tensors (kv scales) are not checkpoint weights
        loaded.update(n for n in targets if n.startswith("paged_mixers."))
        self._start_kernel_warmup()
        return loaded

    def _start_kernel_warmup(self) -> None:
        """After the engine's first weight load (not a later update): the child that compiles the KDA prefill's
        kernels (``model.kernel_warmup``), so that it overlaps the region compiles and the graph capture, not
        the load it slowed when it started with the model."""
        if self._warmup_spec is not None:
            self.kernel_warmup = start_kda_warmup(*self._warmup_spec)
            self._warmup_spec = None

    # --- recurrent-state sizing (called on the class before the model exists) --------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_config
        return kda_state_shapes(config, kda_state_depth(config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return kda_state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return kda_state_copy_funcs()
