"""Convert foreign checkpoints into ours: ``python -m model.convert kimi_linear SRC_DIR DST_DIR``.

``kimi_linear``: a Hugging Face Kimi Linear checkpoint (``config.json`` with ``model_type:
kimi_linear``, ``*.safetensors``, one file or sharded with ``model.safetensors.index.json``) becomes
our ``config.json`` + ``model.safetensors`` that ``HybridForCausalLM.from_pretrained(DST_DIR)`` loads
and that computes the same function as transformers' ``KimiLinearForCausalLM``.

Config: the Kimi Linear fields are read through transformers' ``KimiLinearConfig`` (which resolves
its aliases and ``linear_attn_config``) and set our switches to Kimi Linear's behaviour: unbounded
KDA gate, low-rank KDA output gate, MLA without output gate and with latent-norm eps 1e-6, SiLU
GLUs, no AttnRes, plain (non-latent) experts, group-limited routing as configured.

Weights: both layouts are accepted, the one ``save_pretrained`` and the published checkpoints use
(``q_conv1d``/``k_conv1d``/``v_conv1d``, ``experts.N.w1/w2/w3``, ``block_sparse_moe``; dense layers
under ``mlp`` or ``block_sparse_moe``) and transformers' in-memory one (``conv1d`` stacked,
``forget_gate.*``, ``mlp.experts.gate_up_proj`` / ``down_proj`` as [E, ...] tensors). Every target
tensor must be produced exactly once with its shape; anything left over is an error. The routed
experts come out stacked, as our model holds them ([E, ...] parameters). Dtypes are
kept (the router bias stays fp32 in our model anyway). The whole state dict is held in memory and
written as one file. The source's other top-level files (tokenizer, chat template, generation
config) are copied beside it.

Refused with a message naming the field: attention biases, grouped-query MLA
(``num_key_value_heads`` != ``num_attention_heads``: transformers' own Kimi Linear cannot run it
either), a hidden_act other than SiLU, a non-sigmoid router, MoE layers that are not a suffix of
the layer stack (``mlp_layer_types``), tied embeddings without an ``lm_head.weight``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import HybridConfig
from model.moe import stack_expert_weights

# ---------------------------------------------------------------------------- config

KIMI_LINEAR_SWITCHES = dict(
    mla_use_nope=True,
    mla_use_output_gate=False,
    mla_norm_eps=1e-6,  # KimiLinearRMSNorm's default: its q_a/kv_a norms do not get rms_norm_eps
    routed_expert_hidden_size=None,  # experts on the hidden size: no latent MoE
    moe_router_activation_func="sigmoid",
    attn_res_block_size=0,
    hidden_act="silu",
    tie_word_embeddings=False,
    kda_gate="unbounded",
)
"""Our switches set to Kimi Linear's behaviour (with ``linear_attn_config.use_full_rank_gate: false``): what
a converted checkpoint and the matched peer of ``model.export.kimi_linear_matched`` share."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return json.loads(path.read_text())


def kimi_linear_config(src: Path) -> HybridConfig:
    """Our HybridConfig computing what the Kimi Linear config at ``src`` computes."""
    from transformers import KimiLinearConfig

    raw = _read_json(src / "config.json")
    if raw.get("model_type") != "kimi_linear":
        raise ValueError(
            f"{src}/config.json: model_type must be 'kimi_linear', got {raw.get('model_type')!r}"
        )
    router = raw.get("moe_router_activation_func", "sigmoid")
    if router != "sigmoid":
        raise ValueError(
            f"moe_router_activation_func must be 'sigmoid' (Kimi Linear's router), got {router!r}"
        )
    for field, want in (("moe_layer_freq", 1), ("num_nextn_predict_layers", 0)):
        if raw.get(field, want) != want:  # transformers' Kimi Linear ignores both: refuse, not guess
            raise ValueError(f"{field} must be {want} (as in transformers' Kimi Linear), got {raw[field]!r}")
    if raw.get("mla_use_nope", True) is not True:
        raise ValueError("mla_use_nope must be true: only NoPE MLA is supported")
    kl = KimiLinearConfig.from_pretrained(str(src))
    _check_kimi_linear(kl)
    layer_types = list(kl.layer_types)
    mlp_types = list(kl.mlp_layer_types)
    first_dense = _dense_prefix(mlp_types)
    num_experts = kl.num_local_experts if first_dense < kl.num_hidden_layers else 0
    return HybridConfig(
        **KIMI_LINEAR_SWITCHES,
        vocab_size=kl.vocab_size,
        hidden_size=kl.hidden_size,
        num_hidden_layers=kl.num_hidden_layers,
        linear_attn_config={
            "head_dim": kl.linear_head_dim,
            "num_heads": kl.linear_num_heads,
            "short_conv_kernel_size": kl.linear_conv_kernel_dim,
            "use_full_rank_gate": False,
            "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"],
        },
        num_attention_heads=kl.num_attention_heads,
        kv_lora_rank=kl.kv_lora_rank,
        q_lora_rank=kl.q_lora_rank,
        qk_nope_head_dim=kl.qk_nope_head_dim,
        qk_rope_head_dim=kl.qk_rope_head_dim,
        v_head_dim=kl.v_head_dim,
        num_experts=num_experts,
        num_experts_per_token=kl.num_experts_per_tok,
        num_shared_experts=kl.n_shared_experts,
        moe_intermediate_size=kl.moe_intermediate_size,
        moe_renormalize=kl.norm_topk_prob,
        routed_scaling_factor=kl.routed_scaling_factor,
        num_expert_group=kl.n_group,
        topk_group=kl.topk_group,
        first_k_dense_replace=first_dense,
        intermediate_size=kl.intermediate_size,
        rms_norm_eps=kl.rms_norm_eps,
        initializer_range=kl.initializer_range,
        bos_token_id=kl.bos_token_id,
        eos_token_id=kl.eos_token_id,
        pad_token_id=kl.pad_token_id,
    )


def _check_kimi_linear(kl) -> None:
    checks = [
        (not kl.attention_bias, "attention_bias must be false (our MLA has no projection biases)"),
        (
            kl.num_key_value_heads == kl.num_attention_heads,
            f"num_key_value_heads ({kl.num_key_value_heads}) must equal num_attention_heads "
            f"({kl.num_attention_heads}): MLA expands one latent per head",
        ),
        (
            kl.hidden_act == "silu",
            f"hidden_act must be 'silu' (conv and GLU activation), got {kl.hidden_act!r}",
        ),
        (
            set(kl.layer_types) <= {"linear_attention", "full_attention"},
            f"layer_types must be 'linear_attention' / 'full_attention', got {sorted(set(kl.layer_types))}",
        ),
        (
            len(kl.layer_types) == len(kl.mlp_layer_types) == kl.num_hidden_layers,
            "layer_types and mlp_layer_types need one entry per layer",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"kimi_linear config: {message}")


def _dense_prefix(mlp_types: list[str]) -> int:
    """first_k_dense_replace from mlp_layer_types, which must be dense* sparse*."""
    k = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
    if set(mlp_types[:k]) - {"dense"} or set(mlp_types[k:]) - {"sparse"}:
        raise ValueError(
            f"kimi_linear config: mlp_layer_types must be dense layers then sparse ones, got {mlp_types}"
        )
    return k


# ---------------------------------------------------------------------------- weights


def read_safetensors(src: Path) -> dict[str, torch.Tensor]:
    index = src / "model.safetensors.index.json"
    files = sorted(set(_read_json(index)["weight_map"].values())) if index.is_file() else None
    if files is None:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(src / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[key] = f.get_tensor(key)
    return tensors


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_RENAMES = [  # (source suffix regex, our suffix); applied to the part after model.layers.N.
    (r"self_attn\.forget_gate\.(f_a_proj|f_b_proj)\.weight", r"self_attn.\1.weight"),
    (r"self_attn\.forget_gate\.dt_bias", "self_attn.dt_bias"),
    (r"(block_sparse_moe|mlp)\.experts\.(\d+)\.w1\.weight", r"block_sparse_moe.experts.\2.gate_proj.weight"),
    (r"(block_sparse_moe|mlp)\.experts\.(\d+)\.w3\.weight", r"block_sparse_moe.experts.\2.up_proj.weight"),
    (r"(block_sparse_moe|mlp)\.experts\.(\d+)\.w2\.weight", r"block_sparse_moe.experts.\2.down_proj.weight"),
    (r"(block_sparse_moe|mlp)\.(gate\.weight|gate\.e_score_correction_bias)", r"block_sparse_moe.\2"),
    (r"(block_sparse_moe|mlp)\.shared_experts\.(\w+)\.weight", r"block_sparse_moe.shared_experts.\2.weight"),
]


def kimi_linear_state_dict(src_sd: dict[str, torch.Tensor], config: HybridConfig) -> dict[str, torch.Tensor]:
    """Our state dict (names and shapes checked against the model built on the meta device)."""
    from model.modeling import HybridForCausalLM

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in HybridForCausalLM(config).state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    mapped: list[tuple[str, torch.Tensor]] = []
    sources: dict[str, str] = {}

    def put(name: str, t: torch.Tensor, source: str) -> None:
        mapped.append((name, t))
        sources.setdefault(name, source)

    for key, t in src_sd.items():
        _map_tensor(key, t, config, put)
    # per-expert tensors stacked as the model holds them (a duplicate among them is an error there)
    for name, t in stack_expert_weights(mapped, config.num_experts):
        source = sources.get(name, name.rsplit(".", 1)[0] + ".*")
        if name not in expected:
            raise ValueError(f"source tensor {source!r} maps to {name!r}, which our model does not have")
        if name in out:
            raise ValueError(f"two source tensors map to {name!r} (the second: {source!r})")
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{source!r} -> {name!r}: shape {tuple(t.shape)}, expected {expected[name]}")
        out[name] = t.contiguous()
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    return out


def _map_tensor(key: str, t: torch.Tensor, config: HybridConfig, put: Callable) -> None:
    m = _LAYER.match(key)
    if m is None:
        put(key, t, key)  # embed_tokens, norm, lm_head: same names
        return
    i, rest = int(m.group(1)), m.group(2)
    prefix = f"model.layers.{i}."
    is_moe = config.is_moe_layer(i)
    if rest in ("self_attn.A_log", "self_attn.forget_gate.A_log"):  # [1, 1, H, 1] -> [H]
        put(prefix + "self_attn.A_log", t.reshape(-1), key)
    elif rest == "self_attn.conv1d.weight":  # q, k, v convs stacked on dim 0
        for name, part in zip(("q", "k", "v"), t.chunk(3, dim=0), strict=True):
            put(prefix + f"self_attn.{name}_conv1d.weight", part, key)
    elif re.fullmatch(r"(block_sparse_moe|mlp)\.(gate|up|down)_proj\.weight", rest) and not is_moe:
        put(prefix + "mlp." + rest.split(".", 1)[1], t, key)  # a dense FFN, saved under either name
    elif re.fullmatch(r"(block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)", rest):  # [E, 2I, D], [E, D, I]
        put(prefix + "block_sparse_moe.experts." + rest.rsplit(".", 1)[1], t, key)  # our layout already
    elif "shared_experts" in rest and config.num_shared_experts == 0:
        if t.numel():
            raise ValueError(f"{key!r}: shared expert weights with num_shared_experts = 0")
    else:
        for pattern, repl in _RENAMES:
            if re.fullmatch(pattern, rest):
                rest = re.sub(pattern, repl, rest)
                break
        put(prefix + rest, t, key)


# ---------------------------------------------------------------------------- CLI


def convert_kimi_linear(src: str | Path, dst: str | Path) -> HybridConfig:
    """Write our checkpoint (config.json + model.safetensors) for the Kimi Linear one at ``src``."""
    src, dst = Path(src), Path(dst)
    config = kimi_linear_config(src)
    state = kimi_linear_state_dict(read_safetensors(src), config)
    dst.mkdir(parents=True, exist_ok=True)
    config.architectures = ["HybridForCausalLM"]  # what model.save_pretrained writes (vLLM reads it)
    config.save_pretrained(str(dst))
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    copy_side_files(src, dst)
    return config


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the checkpoint's other top-level files (tokenizer, chat template, generation config,
    the tokenizer's remote code) so DST_DIR carries the checkpoint's own tokenizer."""
    copied = []
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in _NOT_COPIED and path.suffix != ".safetensors":
            shutil.copy2(path, dst / path.name)
            copied.append(path.name)
    return copied


_NOT_COPIED = {"config.json", "model.safetensors.index.json"}
CONVERTERS = {"kimi_linear": convert_kimi_linear}


def layout_cli(argv: list[str] | None, prog: str, doc: str, writers: dict, helps: tuple[str, str, str]) -> int:
    """``prog LAYOUT SRC DST``: ``writers[LAYOUT](SRC, DST)``, a bad input printed as one error line (exit 2).
    Shared by ``model.convert`` and ``model.export``; ``helps``: the layout's, SRC's and DST's help."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("layout", choices=sorted(writers), help=helps[0])
    parser.add_argument("src", help=helps[1])
    parser.add_argument("dst", help=helps[2])
    args = parser.parse_args(argv)
    try:
        config = writers[args.layout](args.src, args.dst)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} ({config.num_hidden_layers} layers, {config.num_experts} experts)")
    return 0


def main(argv: list[str] | None = None) -> int:
    helps = ("the source checkpoint's layout", "source checkpoint directory", "directory to write our checkpoint to")
    return layout_cli(argv, "python -m model.convert", __doc__, CONVERTERS, helps)


if __name__ == "__main__":
    sys.exit(main())
