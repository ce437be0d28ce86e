"""In-process engines share the process's vLLM distributed groups: shutting one down must leave the
others working (vLLM's EngineCore.shutdown tears those groups down; the worker lets only the last
in-process engine alive do that)."""

from __future__ import annotations

import pytest

from rollout.worker import RolloutWorker, TurnRequest

pytestmark = pytest.mark.vllm


def test_shutting_down_one_in_process_engine_spares_the_others(session_worker, tiny_ckpt):
    path, _ = tiny_ckpt
    before = session_worker.generate([TurnRequest("sd0", [5, 6, 7, 8], max_tokens=4, temperature=0.0)])[0]
    other = RolloutWorker(
        dict(
            model_path=str(path),
            reuse="none",
            max_model_len=256,
            max_num_seqs=2,
            kv_cache_memory_bytes=8 << 20,
        )
    )
    assert other.generate([TurnRequest("x", [5, 6, 7, 8], max_tokens=4, temperature=0.0)])[0].token_ids == (
        before.token_ids
    )
    other.shutdown()
    after = session_worker.generate([TurnRequest("sd1", [5, 6, 7, 8], max_tokens=4, temperature=0.0)])[0]
    assert after.token_ids == before.token_ids
    session_worker.end_sessions(["sd0", "sd1"])
