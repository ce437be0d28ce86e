"""WorkerConfig's engine arguments that matter on a GPU, checked without starting an engine: the
attention backend the latent MLA form needs there, and the GPU share for several engines on one GPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rollout.worker import WorkerConfig, latent_attention_backend


def _checkpoint(tmp_path, kv_lora_rank: int, rope: int, form: str | None = None):
    cfg = {"model_type": "longhorizon_hybrid", "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": rope}
    if form:
        cfg["mla_cache_form"] = form
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_latent_form_on_cuda_with_a_wide_head_takes_triton_attention(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path, kv_lora_rank=256, rope=64)  # gpu_1b: 320, padded to 512
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert latent_attention_backend(WorkerConfig(model_path=path, mla_cache_form="latent")) == "TRITON_ATTN"
    assert latent_attention_backend(WorkerConfig(model_path=path, mla_cache_form="expanded")) is None
    # unset (the checkpoint names no form) and "auto" are the latent form on CUDA
    assert latent_attention_backend(WorkerConfig(model_path=path)) == "TRITON_ATTN"
    assert latent_attention_backend(WorkerConfig(model_path=path, mla_cache_form="auto")) == "TRITON_ATTN"
    # the form can come from the checkpoint's config.json too, and the worker's field overrides it
    expanded = _checkpoint(tmp_path, kv_lora_rank=256, rope=64, form="expanded")
    assert latent_attention_backend(WorkerConfig(model_path=expanded)) is None
    assert latent_attention_backend(WorkerConfig(model_path=expanded, mla_cache_form="latent")) == "TRITON_ATTN"


def test_narrow_latent_head_and_cpu_keep_vllms_pick(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path, kv_lora_rank=128, rope=64)  # 192: FlashAttention-3 takes it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert latent_attention_backend(WorkerConfig(model_path=path, mla_cache_form="latent")) is None
    wide = _checkpoint(tmp_path, kv_lora_rank=256, rope=64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert latent_attention_backend(WorkerConfig(model_path=wide, mla_cache_form="latent")) is None


def test_gpu_fields_are_plain_config_fields(tmp_path):
    path = _checkpoint(tmp_path, 32, 16)
    c = WorkerConfig(model_path=path, attention_backend="FLASH_ATTN", gpu_memory_utilization=0.1)
    assert (c.attention_backend, c.gpu_memory_utilization) == ("FLASH_ATTN", 0.1)
    with pytest.raises(ValueError, match="mla_cache_form"):
        WorkerConfig(model_path=path, mla_cache_form="compressed")


def test_turn_outputs_default_to_final_and_bad_values_are_refused(tmp_path):
    path = _checkpoint(tmp_path, 32, 16)
    assert WorkerConfig(model_path=path).turn_outputs == "final"
    assert WorkerConfig(model_path=path, turn_outputs="delta").turn_outputs == "delta"
    with pytest.raises(ValueError, match=r"turn_outputs must be one of \('final', 'delta'\), got 'cumulative'"):
        WorkerConfig(model_path=path, turn_outputs="cumulative")


def test_capture_sizes_are_checked_and_name_a_vllm_field(tmp_path):
    """``cudagraph_capture_sizes`` goes to vLLM as ``compilation_config``: a field vLLM's CompilationConfig
    has (a vLLM that renamed it fails here, not in a GPU run); bad lists are refused up front."""
    from vllm.config import CompilationConfig

    path = _checkpoint(tmp_path, 32, 16)
    assert WorkerConfig(model_path=path, cudagraph_capture_sizes=[1, 2, 4, 64]).cudagraph_capture_sizes == [1, 2, 4, 64]
    assert CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 64]).cudagraph_capture_sizes == [1, 2, 4, 64]
    for bad in ([], [0, 8], [2.5]):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            WorkerConfig(model_path=path, cudagraph_capture_sizes=bad)


def test_default_capture_sizes_are_powers_of_two_from_two_up_to_max_num_seqs():
    from rollout.worker import capture_sizes

    assert capture_sizes(128) == [2, 4, 8, 16, 32, 64, 128]
    assert capture_sizes(65) == [2, 4, 8, 16, 32, 64, 65]
    assert capture_sizes(1) == [1] and capture_sizes(2) == [2] and capture_sizes(3) == [2, 3]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_sampled_logprobs_read_alike_from_flat_and_per_position_containers():
    """The worker asks vLLM for flat logprobs; both containers give the sampled tokens' logprobs, the
    sampled token first at a position even where it is not the most likely one (rank 3 below)."""
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    from rollout.worker import _sampled_logprobs

    tokens = [7, 3, 9]
    rows = [  # (token ids, logprobs, ranks) of a position, the sampled token first
        ([7], [-0.5], [1]), ([3, 4], [-2.25, -0.1], [3, 1]), ([9], [-1.0], [1])
    ]
    flat, nested = FlatLogprobs(), []
    for ids, lps, ranks in rows:
        flat.append_fast(ids, lps, iter(ranks), [None] * len(ids))
        nested.append({t: Logprob(logprob=lp, rank=r) for t, lp, r in zip(ids, lps, ranks)})
    want = [-0.5, -2.25, -1.0]
    assert _sampled_logprobs(SimpleNamespace(logprobs=flat, token_ids=tokens)) == want
    assert _sampled_logprobs(SimpleNamespace(logprobs=nested, token_ids=tokens)) == want
    nan = _sampled_logprobs(SimpleNamespace(logprobs=None, token_ids=tokens))
    assert len(nan) == 3 and all(x != x for x in nan)


def _engine_kwargs(monkeypatch, cfg: WorkerConfig) -> dict:
    """The keyword arguments ``RolloutWorker._start_engine`` gives vLLM's ``LLM`` (recorded, not started)."""
    import vllm

    from rollout.worker import RolloutWorker

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kw: seen.update(kw) or "engine")
    assert RolloutWorker._start_engine(SimpleNamespace(config=cfg)) == "engine"
    return seen


def test_kda_state_depth_is_left_to_the_model_except_under_prefix_caching(tmp_path, monkeypatch):
    """Unset, the engine's config carries no depth (the plugin reads that as auto: the KDA states stacked), except
    with reuse="prefix_cache", whose whole-block reuse a stack's larger block would coarsen: depth 1 there. A depth
    the user names goes through as named."""
    pytest.importorskip("vllm")
    from rollout import worker

    path = _checkpoint(tmp_path, kv_lora_rank=128, rope=64)
    monkeypatch.setattr(worker, "set_engine_process", lambda in_process: None)
    for reuse in ("session", "none"):
        kwargs = _engine_kwargs(monkeypatch, WorkerConfig(model_path=path, reuse=reuse))
        assert "kda_state_depth" not in kwargs.get("hf_overrides", {})
    kwargs = _engine_kwargs(monkeypatch, WorkerConfig(model_path=path, reuse="prefix_cache"))
    assert kwargs["hf_overrides"]["kda_state_depth"] == 1
    named = WorkerConfig(model_path=path, reuse="prefix_cache", kda_state_depth="auto")
    assert _engine_kwargs(monkeypatch, named)["hf_overrides"]["kda_state_depth"] == "auto"


def test_session_workers_schedule_synchronously(tmp_path, monkeypatch):
    """A session worker's engine gets async scheduling off (a stale step past a turn's stop token would move the
    parked session's recurrent state: ``scheduling_kwargs``); workers without sessions keep vLLM's default."""
    pytest.importorskip("vllm")
    from rollout import worker

    path = _checkpoint(tmp_path, kv_lora_rank=128, rope=64)
    monkeypatch.setattr(worker, "set_engine_process", lambda in_process: None)
    assert _engine_kwargs(monkeypatch, WorkerConfig(model_path=path))["async_scheduling"] is False
    for reuse in ("none", "prefix_cache"):
        assert "async_scheduling" not in _engine_kwargs(monkeypatch, WorkerConfig(model_path=path, reuse=reuse))
    # async sessions keep vLLM's default and build the model with its stale-step guard
    kwargs = _engine_kwargs(monkeypatch, WorkerConfig(model_path=path, async_sessions=True, mla_cache_form="latent"))
    assert "async_scheduling" not in kwargs
    assert kwargs["hf_overrides"] == {"mla_cache_form": "latent", "stale_step_guard": True}
    with pytest.raises(ValueError, match="async_sessions applies to reuse='session' only"):
        WorkerConfig(model_path=path, reuse="none", async_sessions=True)
    with pytest.raises(ValueError, match="async_sessions needs in_process=True"):  # a separate core: a hang before
        WorkerConfig(model_path=path, async_sessions=True, in_process=False)
    from rollout import vllm_compat

    monkeypatch.setattr(vllm_compat, "session_rollback", lambda: vllm_compat.MISSING)  # a vLLM without the rollback
    with pytest.raises(ValueError, match="async_sessions needs a vLLM scheduler that rolls a stopped session back"):
        _engine_kwargs(monkeypatch, WorkerConfig(model_path=path, async_sessions=True))
