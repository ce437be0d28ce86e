"""HybridConfig: K3 field names, validation, presets (param counts on meta), registrations."""

from __future__ import annotations

import pytest
from model_cases import PRESETS

from model.config import HybridConfig, hybrid_layer_pattern
from model.params import count_parameters


def test_k3_field_names_and_layer_pattern():
    config = HybridConfig(num_hidden_layers=9)
    kda, full = config.linear_attn_config["kda_layers"], config.linear_attn_config["full_attn_layers"]
    assert (kda, full) == hybrid_layer_pattern(9) == ([1, 2, 3, 5, 6, 7], [4, 8, 9])
    assert [config.is_kda_layer(i) for i in range(9)] == [i + 1 in kda for i in range(9)]
    for field in [
        "hidden_size",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "num_attention_heads",
        "mla_use_nope",
        "mla_use_output_gate",
        "num_experts",
        "num_experts_per_token",
        "num_shared_experts",
        "moe_intermediate_size",
        "routed_expert_hidden_size",
        "moe_router_activation_func",
        "moe_renormalize",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "intermediate_size",
        "attn_res_block_size",
        "hidden_act",
        "rms_norm_eps",
        "tie_word_embeddings",
    ]:
        assert hasattr(config, field), field
    lac = config.linear_attn_config
    assert {"head_dim", "num_heads", "short_conv_kernel_size", "gate_lower_bound"} <= lac.keys()
    assert lac["gate_lower_bound"] == -5.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [2, 3, 4]}}, "both"),
        ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [4]}}, "missing"),
        ({"kda_gate": "tanh"}, "kda_gate"),
        ({"moe_balancing": "aux"}, "moe_balancing"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_experts": 4, "num_experts_per_token": 4}, "num_experts_per_token"),
        ({"linear_attn_config": {"gate_lower_bound": 1.0}}, "gate_lower_bound"),
    ],
)
def test_invalid_configs_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        HybridConfig(num_hidden_layers=4, **overrides)


def test_auto_config_round_trip(tmp_path):
    from transformers import AutoConfig

    config = HybridConfig.from_yaml(PRESETS / "cpu_tiny.yaml")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, HybridConfig)
    assert loaded.linear_attn_config == config.linear_attn_config
    assert loaded.to_diff_dict() == config.to_diff_dict()


def test_from_yaml_overrides_and_errors(tmp_path):
    config = HybridConfig.from_yaml(PRESETS / "cpu_tiny.yaml", moe_balancing="frozen")
    assert config.moe_balancing == "frozen" and config.vocab_size == 1024
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        HybridConfig.from_yaml(bad)


@pytest.mark.parametrize(
    "preset, total_range, active_range",
    [
        ("cpu_tiny.yaml", (1e6, 8e6), (0.5e6, 8e6)),
        ("gpu_1b.yaml", (0.8e9, 1.3e9), (0.15e9, 0.3e9)),
        ("gpu_8b.yaml", (6e9, 10e9), (1e9, 2e9)),
    ],
)
def test_preset_parameter_counts(preset, total_range, active_range):
    config = HybridConfig.from_yaml(PRESETS / preset)
    kda, full = config.linear_attn_config["kda_layers"], config.linear_attn_config["full_attn_layers"]
    assert len(kda) == 3 * len(full) or len(kda) == 3 * (len(full) - 1)  # K3's 3 : 1
    assert config.attn_res_block_size and config.kda_gate == "bounded"
    count = count_parameters(config)
    assert total_range[0] <= count.total <= total_range[1], count
    assert active_range[0] <= count.active <= active_range[1], count


def test_param_count_matches_a_real_model():
    from model.modeling import HybridForCausalLM

    for tie in (True, False):
        config = HybridConfig.from_yaml(PRESETS / "cpu_tiny.yaml", tie_word_embeddings=tie)
        real = sum(p.numel() for p in HybridForCausalLM(config).parameters())
        count = count_parameters(config)
        assert count.total == real
        per_expert = 3 * config.routed_expert_hidden_size * config.moe_intermediate_size
        inactive = (config.num_experts - config.num_experts_per_token) * per_expert
        assert count.active == real - inactive * len(config.moe_layer_indices)


def test_transformers_does_not_take_our_kernels_package_for_hf_kernels():
    import importlib

    from transformers.utils import import_utils

    import kernels
    import kernels.kda

    assert kernels.__file__.endswith("kernels/__init__.py")
    assert import_utils.is_kernels_available() is False
    importlib.import_module("model.modeling")  # importing the model must not flip it
    assert import_utils.is_kernels_available() is False


def test_model_package_is_import_light():
    import subprocess
    import sys

    code = "import sys, model; print('transformers' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
