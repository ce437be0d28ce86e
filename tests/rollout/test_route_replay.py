"""bench/route_replay.py on the CPU: recorded expert routes replayed inside a real vLLM engine (the mla part
of bench/rollout_gpu.py compares the two MLA cache forms with one engine's routes replayed in the other)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_cases import SMALL_ENGINE

from rollout.worker import TurnRequest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "route_replay.py"


def test_routes_at_looks_positions_up_and_routes_the_rest_freely(bench):
    table_PLK = torch.arange(3 * 2 * 2).view(3, 2, 2)
    got = bench.routes_at(table_PLK, torch.tensor([2, 0, 3, -1]))
    assert torch.equal(got[0], table_PLK[2]) and torch.equal(got[1], table_PLK[0])
    assert (got[2:] == -1).all()  # past the table, and a negative (padding) position
    assert (bench.routes_at(table_PLK[:0], torch.tensor([0, 1])) == -1).all()


def _greedy(worker, prompts: list[list[int]], tag: str, n: int = 6) -> dict:
    outs = worker.generate(
        [TurnRequest(f"{tag}{i}", p, max_tokens=n, temperature=0.0) for i, p in enumerate(prompts)]
    )
    worker.end_sessions([o.session_id for o in outs])
    greedy = [(o.token_ids, o.logprobs, o.routed_experts, o.prompt_routed_experts) for o in outs]
    return dict(greedy_prompts=prompts, greedy=greedy)


@pytest.mark.vllm
def test_the_engine_takes_the_replayed_routes(bench, session_worker, tiny_ckpt):
    _, model = tiny_ckpt
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (37, 52)]
    ref = _greedy(session_worker, prompts, "rr")
    same = bench.greedy_forms(ref, ref)
    assert same["all_equal"] and all(r["other_experts_share"] == 0.0 for r in same["rows"])
    # its own routes replayed: the same turns, every forward fed
    own = bench.replayed_greedy(session_worker, ref, "own")
    assert own["all_equal"] and own["routes_applied"], own
    assert all(r["forwards_fed"] >= 6 and r["logprob_max_abs"] < 1e-5 for r in own["rows"])
    # other experts for every prompt token: the engine records (so computes with) exactly those
    E = model.config.num_experts
    moved = [(t, lp, r, np.where(p >= 0, (p + 1) % E, p)) for t, lp, r, p in ref["greedy"]]
    forced = bench.replayed_greedy(session_worker, {**ref, "greedy": moved}, "moved")
    assert forced["routes_applied"], forced
    assert all(not r["tokens_equal"] or r["logprob_max_abs"] > 1e-3 for r in forced["rows"])
    free = bench.greedy_forms(_greedy(session_worker, prompts, "after"), ref)
    assert free["all_equal"]  # the hooks are gone: the shared engine routes freely again


@pytest.mark.vllm
def test_the_device_route_table_routes_every_position(bench, tiny_ckpt, monkeypatch):
    """An engine built with ``LONGHORIZON_ROUTE_TABLE=1`` routes every position of a request (prompt and
    generated tokens) from its device table: forced other experts are the ones it computes with, a bad table
    is refused with the problem named, and a cleared table routes freely again (the tokens of before)."""
    from rollout.worker import RolloutWorker

    path, model = tiny_ckpt
    monkeypatch.setenv("LONGHORIZON_ROUTE_TABLE", "1")
    worker = RolloutWorker(dict(model_path=str(path), reuse="session", **SMALL_ENGINE))
    try:
        prompt = torch.randint(10, 1000, (41,), generator=torch.Generator().manual_seed(5)).tolist()
        toks, _, routed, prompt_routed = _greedy(worker, [prompt], "free")["greedy"][0]
        table_PLK = bench._routes_PLK(toks, routed, prompt_routed)
        E = model.config.num_experts
        moved_PLK = np.where(table_PLK >= 0, (table_PLK + 1) % E, table_PLK)
        worker.llm.collective_rpc(bench.set_route_table, args=(moved_PLK,))
        got = _greedy(worker, [prompt], "forced")["greedy"][0]
        got_PLK = bench._routes_PLK(got[0], got[2], got[3])
        n = len(moved_PLK) - 1  # the last generated token is never fed
        assert got_PLK.shape == moved_PLK.shape and (got_PLK[:n] >= 0).all()
        assert not bench._other_sets_PL(got_PLK[:n], moved_PLK[:n]).any()  # every position, decode included
        with pytest.raises(Exception, match="expert ids must lie in"):
            worker.llm.collective_rpc(bench.set_route_table, args=(np.full_like(moved_PLK, E),))
        with pytest.raises(Exception, match="route table must be"):
            worker.llm.collective_rpc(bench.set_route_table, args=(moved_PLK[:, :1],))
        worker.llm.collective_rpc(bench.set_route_table, args=(None,))
        assert _greedy(worker, [prompt], "again")["greedy"][0][0] == toks
    finally:
        worker.shutdown()
