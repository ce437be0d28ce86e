"""HybridConfig: the Kimi K3 config fields (HF ``PretrainedConfig``) plus a few switches of ours.

Field names follow K3's published ``config.json`` (text_config) so a checkpoint we write reads like
theirs: ``linear_attn_config`` holds the KDA settings and the 1-based layer pattern
(``kda_layers`` / ``full_attn_layers``). Our additions, all with K3's behaviour as default:

* ``kda_gate``: "bounded" (K3: g = g_min * sigmoid(exp(A) * z)) or "unbounded" (Kimi Linear:
  g = -exp(A) * softplus(z)). g_min is ``linear_attn_config["gate_lower_bound"]``.
* ``moe_balancing``: "quantile" (K3 closed form), "quantile_histogram" (K3's estimator at scale),
  "load_quantile" (a proportional load-space rule with a load-quantile reference), "sign"
  (DeepSeek-V3) or "frozen" (RL default choice of the caller). ``moe_balancing_rate`` is the step
  size of the two step-size rules, ``moe_balancing_bins`` the histogram resolution,
  ``moe_balancing_quantile`` the load quantile p of "load_quantile".
* ``attn_res_block_size``: decoder layers per Block-AttnRes block; 0 or None gives the plain
  pre-norm residual stream.

Switches for Kimi Linear checkpoints (``model.convert``), K3's behaviour by default:

* ``linear_attn_config["use_full_rank_gate"]``: True (K3) gives KDA's output gate sigmoid(W_g x) with
  a full-rank ``g_proj``; False gives Kimi Linear's low-rank sigmoid(W_gb W_ga x) (``g_a_proj`` d ->
  head_dim, ``g_b_proj`` head_dim -> H*head_dim).
* ``mla_norm_eps``: eps of MLA's ``q_a_layernorm`` / ``kv_a_layernorm``; None (K3) uses
  ``rms_norm_eps``, Kimi Linear's are 1e-6.
* ``num_expert_group`` / ``topk_group``: DeepSeek-V3 group-limited routing (experts split into
  ``num_expert_group`` groups, a group scored by the sum of its two best biased scores, only the
  ``topk_group`` best groups selectable); 1 / 1 (K3 and Kimi Linear) is plain top-k.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from transformers import AutoConfig, PretrainedConfig

KDA_GATES = ("bounded", "unbounded")
BALANCING_MODES = ("quantile", "quantile_histogram", "load_quantile", "sign", "frozen")
HIDDEN_ACTS = ("situ", "silu")

_LINEAR_ATTN_DEFAULTS: dict[str, Any] = {
    "head_dim": 32,
    "num_heads": 4,
    "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0,
    "use_full_rank_gate": True,
}


def hybrid_layer_pattern(num_layers: int, period: int = 4) -> tuple[list[int], list[int]]:
    """K3's 3 KDA : 1 MLA pattern as 1-based ids: every ``period``-th layer is MLA, and so is the last."""
    full = [i for i in range(1, num_layers + 1) if i % period == 0 or i == num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return kda, full


class HybridConfig(PretrainedConfig):
    """Config of the sparse hybrid (KDA + gated MLA + MoE + Block AttnRes) causal LM."""

    model_type = "longhorizon_hybrid"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 1024,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        linear_attn_config: dict | None = None,
        num_attention_heads: int = 4,
        kv_lora_rank: int = 64,
        q_lora_rank: int | None = None,
        qk_nope_head_dim: int = 32,
        qk_rope_head_dim: int = 16,
        v_head_dim: int = 32,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        mla_norm_eps: float | None = None,
        num_experts: int = 8,
        num_experts_per_token: int = 2,
        num_shared_experts: int = 1,
        moe_intermediate_size: int = 128,
        routed_expert_hidden_size: int | None = None,
        latent_moe_use_norm: bool = True,
        moe_router_activation_func: str = "sigmoid",
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        first_k_dense_replace: int = 0,
        num_expert_group: int = 1,
        topk_group: int = 1,
        intermediate_size: int = 512,
        attn_res_block_size: int | None = 2,
        hidden_act: str = "situ",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        kda_gate: str = "bounded",
        moe_balancing: str = "quantile",
        moe_balancing_rate: float = 1e-3,
        moe_balancing_bins: int = 1000,
        moe_balancing_quantile: float = 0.5,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        lac = {**_LINEAR_ATTN_DEFAULTS, **(linear_attn_config or {})}
        if "kda_layers" not in lac or "full_attn_layers" not in lac:
            lac["kda_layers"], lac["full_attn_layers"] = hybrid_layer_pattern(num_hidden_layers)
        lac["kda_layers"] = [int(i) for i in lac["kda_layers"]]
        lac["full_attn_layers"] = [int(i) for i in lac["full_attn_layers"]]
        self.linear_attn_config = lac
        self.num_attention_heads = num_attention_heads
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.mla_norm_eps = mla_norm_eps
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.first_k_dense_replace = first_k_dense_replace
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.intermediate_size = intermediate_size
        self.attn_res_block_size = attn_res_block_size
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.kda_gate = kda_gate
        self.moe_balancing = moe_balancing
        self.moe_balancing_rate = moe_balancing_rate
        self.moe_balancing_bins = moe_balancing_bins
        self.moe_balancing_quantile = moe_balancing_quantile
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_hybrid()

    # ----------------------------------------------------------------- layer pattern
    def is_kda_layer(self, layer_idx: int) -> bool:
        """0-based index in, K3's 1-based ids inside."""
        return (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_experts > 0 and layer_idx >= self.first_k_dense_replace

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def uses_attn_res(self) -> bool:
        return bool(self.attn_res_block_size)

    # ----------------------------------------------------------------- validation
    def validate_hybrid(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        lac = self.linear_attn_config
        ids = set(range(1, self.num_hidden_layers + 1))
        kda, full = set(lac["kda_layers"]), set(lac["full_attn_layers"])
        if kda & full:
            raise ValueError(f"layers {sorted(kda & full)} are in both kda_layers and full_attn_layers")
        if kda | full != ids:
            raise ValueError(
                f"kda_layers + full_attn_layers must cover layers 1..{self.num_hidden_layers} exactly "
                f"(1-based); missing {sorted(ids - kda - full)}, extra {sorted((kda | full) - ids)}"
            )
        lb = float(lac["gate_lower_bound"])
        if not lb < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be negative, got {lb}")
        checks = [
            (self.kda_gate in KDA_GATES, f"kda_gate must be one of {KDA_GATES}, got {self.kda_gate!r}"),
            (
                self.moe_balancing in BALANCING_MODES,
                f"moe_balancing must be one of {BALANCING_MODES}, got {self.moe_balancing!r}",
            ),
            (
                self.hidden_act in HIDDEN_ACTS,
                f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}",
            ),
            (
                self.moe_router_activation_func == "sigmoid",
                f"only the sigmoid router is implemented, got {self.moe_router_activation_func!r}",
            ),
            (self.mla_use_nope, "only NoPE MLA is implemented (mla_use_nope must be true)"),
            (
                self.num_experts == 0 or 0 < self.num_experts_per_token < self.num_experts,
                f"need 0 < num_experts_per_token ({self.num_experts_per_token}) < num_experts ({self.num_experts})",
            ),
            (
                self.num_experts == 0
                or (
                    self.num_expert_group >= 1
                    and self.num_experts % self.num_expert_group == 0
                    and (self.num_expert_group == 1 or self.num_experts // self.num_expert_group >= 2)
                ),
                f"num_expert_group ({self.num_expert_group}) must divide num_experts ({self.num_experts}) "
                "into groups of at least 2 experts",
            ),
            (
                1 <= self.topk_group <= self.num_expert_group,
                f"need 1 <= topk_group ({self.topk_group}) <= num_expert_group ({self.num_expert_group})",
            ),
            (
                not self.attn_res_block_size or self.attn_res_block_size > 0,
                f"attn_res_block_size must be positive or 0/None, got {self.attn_res_block_size}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    # ----------------------------------------------------------------- YAML
    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> HybridConfig:
        """Build a config from a preset such as ``configs/model/cpu_tiny.yaml``.

        The file is a flat mapping of config fields; ``linear_attn_config`` is a nested mapping.
        A top-level ``model:`` key is unwrapped so experiment files can embed a preset.
        """
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=True)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of config fields, got {type(raw).__name__}")
        if set(raw) == {"model"}:
            raw = raw["model"]
        return cls(**{**raw, **overrides})


AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
