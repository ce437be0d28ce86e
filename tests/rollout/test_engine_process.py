"""A ``RolloutWorker`` whose engine core runs in a process of its own (``in_process=False``, vLLM's default
layout; bench/rollout_gpu.py's ``--engine-process separate``): whole-turn reuse still holds across the
process boundary (the step records come back through ``collective_rpc``), and it samples what the
in-process engine samples."""

from __future__ import annotations

import pytest
from rollout_cases import SMALL_ENGINE

from rollout.worker import RolloutWorker, TurnRequest

pytestmark = pytest.mark.vllm


def _turns(worker: RolloutWorker, sid: str) -> list:
    first = worker.generate([TurnRequest(sid, list(range(5, 69)), max_tokens=6, temperature=0.0)])[0]
    second = worker.generate([TurnRequest(sid, list(range(100, 140)), max_tokens=6, temperature=0.0)])[0]
    worker.end_sessions([sid])
    return [first, second]


def test_a_separate_engine_process_keeps_sessions_and_samples_the_in_process_tokens(
    session_worker, tiny_ckpt, monkeypatch
):
    path, _ = tiny_ckpt
    # the worker sets vLLM's variable for the engine it starts: put it back for the tests after this one
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    worker = RolloutWorker(dict(model_path=str(path), reuse="session", in_process=False, **SMALL_ENGINE))
    try:
        # a process of its own, though an in-process engine started first (vLLM caches its variables then)
        assert type(worker.llm.llm_engine.engine_core).__name__ != "InprocClient"
        separate = _turns(worker, "sep")
    finally:
        worker.shutdown()
    same = _turns(session_worker, "inp")  # the in-process engine outlives the other's shutdown
    assert [o.token_ids for o in separate] == [o.token_ids for o in same]
    assert separate[0].num_computed_prompt_tokens == 64
    # the second turn: its 40 new tokens and the last sampled token (not fed yet) computed, not the history
    assert 40 <= separate[1].num_computed_prompt_tokens <= 42
    assert separate[1].num_computed_prompt_tokens == same[1].num_computed_prompt_tokens
