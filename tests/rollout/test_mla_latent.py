"""The latent-cache MLA form (``mla_cache_form="latent"``) in a real vLLM engine (CPU, fp32): the same
function as the learner and as the expanded form, with a smaller KV page. One extra engine."""

from __future__ import annotations

import pytest
import torch
from rollout_cases import SMALL_ENGINE, build_checkpoint
from test_vllm_engine import LOGPROB_TOL, _prompt, assert_sampled_logprobs_equal_learner, learner_logprobs

from rollout.worker import RolloutWorker, TurnRequest, WorkerConfig

pytestmark = pytest.mark.vllm


def _engine(path, form: str) -> RolloutWorker:
    return RolloutWorker(dict(model_path=str(path), reuse="session", mla_cache_form=form, **SMALL_ENGINE))


@pytest.fixture(scope="module")
def sharp_ckpt(tmp_path_factory):
    """The tiny checkpoint with MLA attention logits x16 and MLA output x2: at random init the MLA
    scores are near zero (attention almost uniform), where a wrong softmax scale moves logprobs by
    only ~4e-5; here by ~5e-3, far above the tolerance."""
    path = tmp_path_factory.mktemp("tiny_sharp_mla")
    model = build_checkpoint(path)
    with torch.no_grad():
        for layer in model.model.layers:
            if not layer.is_kda:
                mla = layer.self_attn
                for w in (
                    mla.q_proj.weight,
                    mla.kv_b_proj.weight,
                    mla.kv_a_proj_with_mqa.weight[mla.kv_lora_rank :],
                ):
                    w.mul_(4.0)
                mla.o_proj.weight.mul_(2.0)
    model.save_pretrained(str(path))
    return path, model


@pytest.fixture(scope="module")
def engines(sharp_ckpt):
    path, _ = sharp_ckpt
    made = {}
    try:
        for form in ("latent", "expanded"):
            made[form] = _engine(path, form)
        yield made
    finally:
        for w in made.values():
            w.shutdown()


@pytest.fixture(scope="module")
def latent_worker(engines):
    return engines["latent"]


def _mla_layout(worker) -> list[tuple[str, int, int, int]]:
    """(layer class, KV heads, head size, KV bytes per token) of every MLA layer in the engine's model."""

    def read(w):
        out = []
        for m in w.model_runner.get_model().paged_mixers:
            if hasattr(m, "attn"):
                spec = m.attn.get_kv_cache_spec(w.vllm_config)
                out.append(
                    (
                        type(m).__name__,
                        m.attn.num_kv_heads,
                        m.attn.head_size,
                        spec.page_size_bytes // spec.block_size,
                    )
                )
        return out

    return worker.llm.collective_rpc(read)[0]


def test_latent_form_cache_is_one_kv_head_and_smaller(engines, sharp_ckpt):
    _, model = sharp_ckpt
    cfg = model.config
    latent, expanded = _mla_layout(engines["latent"]), _mla_layout(engines["expanded"])
    assert latent and len(latent) == len(expanded)
    (name_l, heads_l, size_l, bytes_l), (name_e, heads_e, size_e, bytes_e) = latent[0], expanded[0]
    assert (name_l, name_e) == ("MLALatentPagedAttention", "MLAPagedAttention")
    assert heads_l == 1 and heads_e == cfg.num_attention_heads
    assert size_l >= cfg.kv_lora_rank + cfg.qk_rope_head_dim
    fp32 = 4  # K and V pages, fp32 cache
    assert bytes_l == 2 * heads_l * size_l * fp32 and bytes_e == 2 * heads_e * size_e * fp32
    assert bytes_l < bytes_e, (bytes_l, bytes_e)


def test_latent_form_greedy_equals_expanded_form_and_generate(engines, sharp_ckpt):
    _, model = sharp_ckpt
    latent_worker, expanded_worker = engines["latent"], engines["expanded"]
    prompts = {"lg0": _prompt(40, 50), "lg1": _prompt(41, 90)}
    reqs = [TurnRequest(s, p, max_tokens=12, temperature=0.0) for s, p in prompts.items()]
    latent, expanded = latent_worker.generate(reqs), expanded_worker.generate(reqs)
    for a, b in zip(latent, expanded):
        ref = model.generate(torch.tensor([prompts[a.session_id]]), max_new_tokens=12)[0, -12:].tolist()
        assert a.token_ids == b.token_ids == ref
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        assert diff < LOGPROB_TOL, diff
    latent_worker.end_sessions(list(prompts))
    expanded_worker.end_sessions(list(prompts))


def test_latent_form_sampled_logprobs_equal_learner_logprobs(latent_worker, sharp_ckpt):
    assert_sampled_logprobs_equal_learner(latent_worker, sharp_ckpt[1], "llp", _prompt(42, 60))


def test_latent_form_session_reuse_second_turn(latent_worker, sharp_ckpt):
    _, model = sharp_ckpt
    first, second = _prompt(43, 70), _prompt(44, 15)
    o1 = latent_worker.generate([TurnRequest("lr", first, max_tokens=8, temperature=1.0)])[0]
    o2 = latent_worker.generate([TurnRequest("lr", second, max_tokens=8, temperature=0.0)])[0]
    latent_worker.end_sessions(["lr"])
    assert o2.reused_session and o2.num_computed_prompt_tokens == len(second) + 1  # + turn 1's last token
    history = first + o1.token_ids + second
    assert o2.token_ids == model.generate(torch.tensor([history]), max_new_tokens=8)[0, -8:].tolist()
    ref = learner_logprobs(model, history + o2.token_ids)[len(history) - 1 :]
    diff = (torch.tensor(o2.logprobs) - ref).abs().max().item()
    assert diff < LOGPROB_TOL, diff


def test_unknown_cache_form_and_oversized_latent_are_rejected(sharp_ckpt):
    from model.config import HybridConfig
    from rollout.vllm_plugin import mla_cache_form, mla_kv_layout

    path, _ = sharp_ckpt
    with pytest.raises(ValueError, match="mla_cache_form"):
        WorkerConfig(model_path=str(path), mla_cache_form="compressed")
    cfg = HybridConfig.from_pretrained(str(path))
    assert mla_cache_form(cfg) == "expanded"  # unset: auto, expanded on the CPU
    assert mla_cache_form(cfg, on_cuda=True) == "latent"
    cfg.mla_cache_form = "auto"
    assert (mla_cache_form(cfg, on_cuda=False), mla_cache_form(cfg, on_cuda=True)) == ("expanded", "latent")
    cfg.mla_cache_form = "expanded"
    assert mla_cache_form(cfg, on_cuda=True) == "expanded"
    cfg.mla_cache_form = "dense"
    with pytest.raises(ValueError, match="mla_cache_form"):
        mla_kv_layout(cfg)
    cfg.mla_cache_form = "latent"
    assert mla_kv_layout(cfg) == (1, 64)  # kv_lora_rank 32 + rope 16 -> head size 64
    cfg.kv_lora_rank, cfg.qk_rope_head_dim = 512, 64  # K3's latent: no paged-attention head size fits
    with pytest.raises(ValueError, match="576 exceeds"):
        mla_kv_layout(cfg)


def test_latent_head_is_a_cpu_size_on_the_cpu_and_its_own_width_on_cuda():
    """CPU paged attention takes a fixed list of head sizes; vLLM's Triton backend (the latent form's on CUDA)
    any multiple of 32, so gpu_1b's 256 + 64 latent is cached 320 wide there, not padded to 512."""
    from types import SimpleNamespace

    from rollout.vllm_plugin import latent_head_size

    gpu_1b = SimpleNamespace(kv_lora_rank=256, qk_rope_head_dim=64)
    assert latent_head_size(gpu_1b, on_cuda=False) == 512 and latent_head_size(gpu_1b, on_cuda=True) == 320
    odd = SimpleNamespace(kv_lora_rank=200, qk_rope_head_dim=24)
    assert latent_head_size(odd, on_cuda=False) == 224 and latent_head_size(odd, on_cuda=True) == 224
    k3 = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64)
    assert latent_head_size(k3, on_cuda=True) == 576  # on the CPU: rejected (above)


def test_latent_form_follows_an_in_place_weight_update(latent_worker, sharp_ckpt):
    """W_UK / W_UV are read from kv_b_proj on every call: a weight update must reach the absorbed
    queries and the latent-to-value map (a cached copy would keep the old ones). Runs last: it
    leaves the latent engine on new weights."""
    import copy

    _, model = sharp_ckpt
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in new.model.layers:
            if not layer.is_kda:
                w = layer.self_attn.kv_b_proj.weight
                w.copy_(w.std() * 4.0 * torch.randn(w.shape, generator=g))
    latent_worker.update_weights(new.state_dict(), version=1)
    prompt = _prompt(45, 60)
    o = latent_worker.generate([TurnRequest("lw", prompt, max_tokens=16, temperature=1.0)])[0]
    latent_worker.end_sessions(["lw"])
    assert o.policy_version == 1
    ref = learner_logprobs(new, prompt + o.token_ids)[len(prompt) - 1 :]
    old = learner_logprobs(model, prompt + o.token_ids)[len(prompt) - 1 :]
    assert (ref - old).abs().max().item() > 100 * LOGPROB_TOL  # the update changes the function
    diff = (torch.tensor(o.logprobs) - ref).abs().max().item()
    assert diff < LOGPROB_TOL, diff
