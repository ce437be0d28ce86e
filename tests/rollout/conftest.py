"""Shared fixtures: a tiny random-init hybrid checkpoint in fp32 with every feature of the CPU preset
(KDA x3 + gated MLA, dense first FFN then latent SiTU MoE, Block AttnRes, tied embeddings)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: OpenMP spinning costs 1000x on tiny ops
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

torch.set_num_threads(1)

TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    num_hidden_layers=4,
    linear_attn_config={"head_dim": 32, "num_heads": 2},
    num_attention_heads=2,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_experts=4,
    num_experts_per_token=2,
    moe_intermediate_size=64,
    routed_expert_hidden_size=32,  # latent MoE, as in the CPU preset
    first_k_dense_replace=1,  # one dense FFN layer first
    tie_word_embeddings=True,
    intermediate_size=128,
    attn_res_block_size=2,
    eos_token_id=2,
    pad_token_id=0,
)


# the engine size most rollout tests use: a few short episodes, a 32 MiB KV budget
SMALL_ENGINE = dict(max_model_len=768, max_num_seqs=8, kv_cache_memory_bytes=32 << 20)


def build_checkpoint(path, seed: int = 0, scale_router: float = 20.0):
    """Save a tiny model + the project tokenizer; returns the learner model (eval mode)."""
    from model.config import HybridConfig
    from model.modeling import HybridForCausalLM
    from rollout.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    model = HybridForCausalLM(HybridConfig(**TINY)).eval()
    with torch.no_grad():  # spread router scores so top-k choices are not near-ties
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.mul_(scale_router)
    model.save_pretrained(str(path))
    load_tokenizer().save_pretrained(str(path))
    return model


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hybrid")
    model = build_checkpoint(path)
    return path, model


@pytest.fixture(scope="session")
def session_worker(tiny_ckpt):
    """One session-reuse engine shared by the test modules that do not change its weights."""
    from rollout.worker import RolloutWorker

    path, _ = tiny_ckpt
    w = RolloutWorker(dict(model_path=str(path), reuse="session", **SMALL_ENGINE))
    yield w
    w.shutdown()
