"""Kimi Linear checkpoints: transformers' KimiLinearForCausalLM vs ours after ``model.convert``.

Small random ``KimiLinearConfig``s made with transformers, saved with ``save_pretrained``,
converted, loaded with ``HybridForCausalLM.from_pretrained``; fp32 logits must agree to
``REL_TOL`` of the largest logit (measured <= 2.6e-6 here), for the full forward, incremental decoding
with our cache and packed varlen input. Norm weights, conv weights and router biases are
randomised first (transformers initialises them to constants, which would hide a swapped name).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from model.cache import HybridCache  # noqa: E402
from model.config import HybridConfig  # noqa: E402
from model.convert import kimi_linear_config, kimi_linear_state_dict, main  # noqa: E402
from model.modeling import HybridForCausalLM  # noqa: E402

REL_TOL = 1e-5  # max |ours - theirs| / max |theirs|, fp32

BASE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4,
    qk_nope_head_dim=8, v_head_dim=8, num_local_experts=6, num_experts_per_tok=2,
    linear_head_dim=8, linear_num_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    routed_scaling_factor=2.446,
)  # fmt: skip
CASES = {
    # no q_lora_rank, one dense first layer, one shared expert (Kimi-Linear-48B's shape)
    "plain": dict(num_hidden_layers=4, q_lora_rank=None, first_k_dense_replace=1, n_shared_experts=1,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    # q_lora_rank, two dense layers, two shared experts, MLA first
    "q_lora": dict(num_hidden_layers=4, q_lora_rank=12, first_k_dense_replace=2, n_shared_experts=2,
                   layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
    # no dense layer, no shared expert, no renormalisation, group-limited routing
    "grouped": dict(num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=0, n_shared_experts=0,
                    norm_topk_prob=False, n_group=3, topk_group=2,
                    layer_types=["linear_attention", "full_attention", "linear_attention"]),
}  # fmt: skip


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, theirs, ours) for one case, ours loaded from the converted checkpoint."""
    torch.manual_seed(0)
    cfg = KimiLinearConfig(**BASE, **CASES[request.param])
    theirs = KimiLinearForCausalLM(cfg).eval()
    _randomise(theirs, seed=1)
    src, dst = tmp_path_factory.mktemp("kl_src"), tmp_path_factory.mktemp("kl_dst")
    theirs.save_pretrained(src)
    (src / "tokenizer_config.json").write_text("{}")  # stands for the checkpoint's tokenizer files
    assert main(["kimi_linear", str(src), str(dst)]) == 0
    assert (dst / "tokenizer_config.json").is_file() and (dst / "generation_config.json").is_file()
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["HybridForCausalLM"]
    ours = HybridForCausalLM.from_pretrained(dst).eval()
    return request.param, theirs, ours


def _ids(T: int, seed: int, B: int = 1) -> torch.Tensor:
    return torch.randint(3, BASE["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def _rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@torch.no_grad()
def test_logits_equal_transformers(pair):
    _name, theirs, ours = pair
    ids = _ids(70, seed=2, B=2)  # > one 64-token chunk of transformers' chunked KDA
    ref = theirs(ids).logits
    err = _rel_err(ours(ids).logits, ref)
    print(f"full forward rel err {err:.2e}")
    assert err < REL_TOL, err


@torch.no_grad()
def test_incremental_decoding_equals_full_forward(pair):
    _name, theirs, ours = pair
    ids = _ids(20, seed=3, B=2)
    ref = theirs(ids).logits
    out = ours(ids[:, :12], use_cache=True)
    steps = [out.logits]
    cache: HybridCache = out.past_key_values
    for t in range(12, 20):
        out = ours(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits)
    err = _rel_err(torch.cat(steps, dim=1), ref)
    print(f"decode rel err {err:.2e}")
    assert err < REL_TOL, err


@torch.no_grad()
def test_packed_varlen_equals_separate_sequences(pair):
    _name, theirs, ours = pair
    lengths = [9, 1, 23, 14]
    seqs = [_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    ref = torch.cat([theirs(s).logits for s in seqs], dim=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    err = _rel_err(ours(torch.cat(seqs, dim=1), cu_seqlens=cu).logits, ref)
    print(f"varlen rel err {err:.2e}")
    assert err < REL_TOL, err


def test_converted_config_switches(pair):
    name, _theirs, ours = pair
    c = ours.config
    assert c.kda_gate == "unbounded" and not c.uses_attn_res and not c.mla_use_output_gate
    assert c.linear_attn_config["use_full_rank_gate"] is False and c.hidden_act == "silu"
    assert c.first_k_dense_replace == CASES[name]["first_k_dense_replace"]
    layers = ours.model.layers
    assert all(hasattr(layer.self_attn, "g_a_proj") for layer in layers if layer.is_kda)
    assert c.num_expert_group == CASES[name].get("n_group", 1)


def test_bad_sources_are_refused(tmp_path):
    cfg = KimiLinearConfig(**BASE, **CASES["plain"])
    KimiLinearForCausalLM(cfg).save_pretrained(tmp_path / "ok")
    bias = KimiLinearConfig(**BASE, **CASES["plain"], attention_bias=True)
    bias.save_pretrained(tmp_path / "bias")
    with pytest.raises(ValueError, match="attention_bias"):
        kimi_linear_config(tmp_path / "bias")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "llama"}')
    assert main(["kimi_linear", str(tmp_path / "other"), str(tmp_path / "out")]) == 2
    assert main(["kimi_linear", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2


def test_in_memory_layout_maps_to_the_same_weights(pair):
    """transformers' runtime names (stacked conv1d, forget_gate.*, fused [E, ...] experts) map too."""
    _name, theirs, ours = pair
    runtime = theirs.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in runtime)
    assert any(k.endswith("self_attn.conv1d.weight") for k in runtime)
    mapped = kimi_linear_state_dict(runtime, ours.config)
    reference = ours.state_dict()
    assert mapped.keys() == reference.keys()
    for k, t in mapped.items():
        assert torch.equal(t, reference[k]), k


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_experts": 6, "num_expert_group": 4}, "num_expert_group"),
        ({"num_experts": 6, "num_expert_group": 6}, "num_expert_group"),
        ({"num_experts": 6, "num_expert_group": 3, "topk_group": 4}, "topk_group"),
    ],
)
def test_group_routing_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        HybridConfig(**overrides)


def test_converted_model_trains_and_round_trips(pair, tmp_path):
    """One AdamW step on next-token loss moves every projection kind (the low-rank KDA gate, MLA,
    router, experts); save/load keeps the trained function exactly; LoRA finds the low-rank gate."""
    from peft import LoraConfig, get_peft_model

    from model.lora import lora_target_modules

    _name, _theirs, ours = pair
    model = copy.deepcopy(ours).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids(40, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(ids, labels=ids).loss.backward()
    opt.step()
    after = model.state_dict()
    for part in ("g_a_proj", "g_b_proj", "kv_b_proj", "gate.weight", "experts.gate_up_proj", "A_log"):
        keys = [k for k in after if part in k]
        assert keys and any(not torch.equal(after[k], before[k]) for k in keys), part
    model.eval().save_pretrained(tmp_path / "trained")
    reloaded = HybridForCausalLM.from_pretrained(tmp_path / "trained").eval()
    with torch.no_grad():
        for p in reloaded.parameters():  # fresh (aligned) storage, as the trained model's: safetensors' loads
            p.data = p.data.clone()  # sit at 8-byte offsets, and the CPU's grouped GEMM rounds by alignment
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    lora = get_peft_model(reloaded, LoraConfig(r=2, target_modules=lora_target_modules()))
    assert any(n.endswith("g_a_proj.lora_A.default.weight") for n, _ in lora.named_parameters())


# config.json as Moonshot publishes it (Kimi-Linear-48B-A3B's fields, tiny sizes): K3-style names,
# linear_attn_config with 1-based layer lists, first_k_dense_replace, fields transformers ignores
PUBLISHED_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "auto_map": {"AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "first_k_dense_replace": 1, "head_dim": 72,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48,
    "kv_lora_rank": 8, "linear_attn_config": {"full_attn_layers": [3], "head_dim": 8, "kda_layers": [1, 2, 4],
                                              "num_heads": 2, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 16, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 2,
    "num_expert_group": 1, "num_experts": 6, "num_experts_per_token": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 8, "vocab_size": 96,
}  # fmt: skip


def test_published_config_form_converts_exactly(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(PUBLISHED_CONFIG))
    torch.manual_seed(0)
    theirs = KimiLinearForCausalLM(KimiLinearConfig.from_pretrained(src)).eval()
    assert theirs.config.layer_types[2] == "full_attention" and theirs.config.mlp_layer_types[0] == "dense"
    _randomise(theirs, seed=4)
    theirs.save_pretrained(tmp_path / "saved")
    for f in (tmp_path / "saved").glob("*.safetensors"):
        f.rename(src / f.name)  # the weights beside the published-form config.json
    assert main(["kimi_linear", str(src), str(tmp_path / "dst")]) == 0
    ours = HybridForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert (
        ours.config.linear_attn_config["full_attn_layers"] == [3] and ours.config.first_k_dense_replace == 1
    )
    ids = _ids(30, seed=6)
    with torch.no_grad():
        assert _rel_err(ours(ids).logits, theirs(ids).logits) < REL_TOL
    (src / "config.json").write_text(json.dumps({**PUBLISHED_CONFIG, "moe_layer_freq": 2}))
    with pytest.raises(ValueError, match="moe_layer_freq"):
        kimi_linear_config(src)
