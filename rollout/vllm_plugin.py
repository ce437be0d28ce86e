"""vLLM plugin (entry point ``vllm.general_plugins: longhorizon``): registers our model in every
vLLM process (main, engine core, workers).

It registers the HF config under its ``model_type``, a model-arch convertor that tells vLLM the KV
head size and head count of our MLA layers *as we store them* (``mla_kv_layout``: per the config's
``mla_cache_form``, "expanded" per-head K/V or one "latent" KV head, padded to a CPU-supported head
size; see ``rollout.vllm_layers``), and the model class. vLLM sizes the attention block from this layout
so that one block holds a KDA state page.

The class is registered itself, imported when vLLM loads the plugin, not as a "module:Class" string: vLLM
inspects a string-registered class in a fresh Python subprocess whenever its cache (VLLM_CACHE_ROOT/modelinfos)
has no entry for the module's current source, which cost 11 s on a 2-core CPU and 20 s of an engine's
first call on the H200. Importing this module stays light; ``register`` pulls in vLLM and the model.
"""

from __future__ import annotations

ARCHITECTURE = "HybridForCausalLM"
# CPU_ATTN head sizes (vllm/v1/attention/backends/cpu_attn.py); we pad MLA heads up to one of these.
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


# How MLA layers keep K/V in vLLM's paged cache (HF config field ``mla_cache_form``, settable through
# vLLM's ``hf_overrides``): "expanded" = per-head K/V (exact on CPU); "latent" = one shared KV head holding
# [c_kv ; k_pe] with absorbed queries (multi-query attention over the latent). "auto" (or unset, the default)
# picks latent on CUDA and expanded elsewhere: on an H200 the latent form decoded gpu_1b 1.3-1.8x faster than
# the expanded one (it reads 4.8x fewer KV bytes a token and holds 4.8x the tokens in a budget; bench/RESULTS.md).
MLA_CACHE_FORMS = ("expanded", "latent")
MLA_CACHE_FORM_CHOICES = ("auto", *MLA_CACHE_FORMS)


# How KDA layers keep their recurrent states in vLLM's slots (HF config field ``kda_state_depth``, settable through
# vLLM's ``hf_overrides``): how many KDA layers one vLLM state layer holds (``rollout.vllm_layers.KDAStates``).
# vLLM's KV-cache manager keeps a block table per cache group and does its accounting once per group, request and
# step, and it splits each kind of layer into groups of the smallest kind's count: 12 KDA layers of one state each
# beside 4 MLA layers make 3 KDA groups and 1 MLA group; 4 stacks of 3 make 1 and 1. "auto" (or unset, the
# default): KDA layers / MLA layers where that divides evenly (else 1); 1: one layer a state layer; an int: that depth.
KDA_STATE_DEPTH_CHOICES = ("auto", "an int >= 1 dividing the KDA layer count")


def kda_state_depth(config) -> int:
    """The number of KDA layers one vLLM state layer holds under the config's ``kda_state_depth``."""
    lac = config.linear_attn_config
    n_kda, n_mla = len(lac["kda_layers"]), len(lac["full_attn_layers"])
    depth = getattr(config, "kda_state_depth", None)
    if depth is None or depth == "auto":
        return n_kda // n_mla if n_mla and n_kda >= n_mla and n_kda % n_mla == 0 else 1
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1 or (n_kda and n_kda % depth):
        raise ValueError(f"kda_state_depth must be one of {KDA_STATE_DEPTH_CHOICES} ({n_kda} KDA layers here), "
                         f"got {depth!r}")  # fmt: skip
    return depth


def _cuda_available(on_cuda: bool | None) -> bool:
    """``on_cuda``, or torch's answer when None (every vLLM process of an engine sees the same one, so the
    cache layout vLLM sizes and the one the model builds agree)."""
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    return on_cuda


def mla_cache_form(config, on_cuda: bool | None = None) -> str:
    """The MLA cache form the config asks for, "auto" resolved by the device (latent on CUDA)."""
    form = getattr(config, "mla_cache_form", None) or "auto"
    if form not in MLA_CACHE_FORM_CHOICES:
        raise ValueError(f"mla_cache_form must be one of {MLA_CACHE_FORM_CHOICES}, got {form!r}")
    if form == "auto":
        return "latent" if _cuda_available(on_cuda) else "expanded"
    return form


def _round_up_head_size(need: int, what: str) -> int:
    for size in CPU_ATTN_HEAD_SIZES:
        if size >= need:
            return size
    raise ValueError(f"{what} {need} exceeds the largest paged-attention head size {CPU_ATTN_HEAD_SIZES[-1]}")


def padded_head_size(config) -> int:
    """Head size of the expanded MLA K/V pages: max(qk_nope + qk_rope, v_head_dim) rounded up."""
    need = max(int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim), int(config.v_head_dim))
    return _round_up_head_size(need, "MLA head size")


# On CUDA the latent form runs on vLLM's Triton attention backend (FlashAttention-3 stops at 256), which takes
# any head of at least 32 at its own width: no rounding to a CPU size there (gpu_1b: 320, not 512).
GPU_LATENT_HEAD_MULTIPLE = 32


def latent_head_size(config, on_cuda: bool | None = None) -> int:
    """Head size of the latent MLA pages, kv_lora_rank + qk_rope (V = c_kv fits inside) rounded up: on CUDA to a
    multiple of ``GPU_LATENT_HEAD_MULTIPLE``, elsewhere to a CPU paged-attention head size. ``on_cuda``: None
    asks torch."""
    need = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    if _cuda_available(on_cuda):
        return -(-need // GPU_LATENT_HEAD_MULTIPLE) * GPU_LATENT_HEAD_MULTIPLE
    return _round_up_head_size(need, "MLA latent size (kv_lora_rank + qk_rope_head_dim)")


def mla_kv_layout(config) -> tuple[int, int]:
    """(KV heads, head size) of one MLA layer's paged cache under the configured ``mla_cache_form``."""
    if mla_cache_form(config) == "latent":
        return 1, latent_head_size(config)
    return int(config.num_attention_heads), padded_head_size(config)


def _register_arch_convertor(model_type: str) -> None:
    from vllm.transformers_utils import model_arch_config_convertor as mac

    class HybridArchConvertor(mac.ModelArchConfigConvertorBase):
        def get_head_size(self) -> int:
            return mla_kv_layout(self.hf_text_config)[1]

        def get_total_num_kv_heads(self) -> int:
            return mla_kv_layout(self.hf_text_config)[0]

    mac.MODEL_ARCH_CONFIG_CONVERTORS[model_type] = HybridArchConvertor


def register() -> None:
    from vllm import ModelRegistry

    from model.config import HybridConfig  # registers the config with AutoConfig
    from rollout.vllm_compat import backport_session_rollback, install_decode_allocation, install_input_ids

    _register_arch_convertor(HybridConfig.model_type)
    backport_session_rollback()  # sessions under an async scheduler (rollout.vllm_compat)
    install_decode_allocation()  # a decode step's KV slots without vLLM's per-group walk (rollout.vllm_compat)
    install_input_ids()  # an async step's input ids without vLLM's loop over the batch (rollout.vllm_compat)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        from rollout.vllm_model import VllmHybridForCausalLM  # the class: no inspection subprocess

        ModelRegistry.register_model(ARCHITECTURE, VllmHybridForCausalLM)
