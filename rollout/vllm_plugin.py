"""vLLM plugin (entry point ``vllm.general_plugins: longhorizon``): registers our model in every
vLLM process (main, engine core, workers).

It registers the HF config under its ``model_type``, a model-arch convertor that tells vLLM the KV
head size and head count of our MLA layers *as we store them* (expanded per-head K/V, padded to a
CPU-supported head size; see ``rollout.vllm_model``), and the model class, lazily by string so the
plugin stays import-light.
"""

from __future__ import annotations

ARCHITECTURE = "HybridForCausalLM"
MODEL_CLASS = "rollout.vllm_model:VllmHybridForCausalLM"
# CPU_ATTN head sizes (vllm/v1/attention/backends/cpu_attn.py); we pad MLA heads up to one of these.
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def padded_head_size(config) -> int:
    """Head size of the expanded MLA K/V pages: max(qk_nope + qk_rope, v_head_dim) rounded up."""
    need = max(int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim), int(config.v_head_dim))
    for size in CPU_ATTN_HEAD_SIZES:
        if size >= need:
            return size
    raise ValueError(
        f"MLA head size {need} exceeds the largest paged-attention head size {CPU_ATTN_HEAD_SIZES[-1]}"
    )


def _register_arch_convertor(model_type: str) -> None:
    from vllm.transformers_utils import model_arch_config_convertor as mac

    class HybridArchConvertor(mac.ModelArchConfigConvertorBase):
        def get_head_size(self) -> int:
            return padded_head_size(self.hf_text_config)

        def get_total_num_kv_heads(self) -> int:
            return int(self.hf_text_config.num_attention_heads)

    mac.MODEL_ARCH_CONFIG_CONVERTORS[model_type] = HybridArchConvertor


def register() -> None:
    from vllm import ModelRegistry

    from model.config import HybridConfig  # registers the config with AutoConfig

    _register_arch_convertor(HybridConfig.model_type)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
