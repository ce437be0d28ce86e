"""bench/route_replay.py on the CPU: recorded expert routes replayed inside a real vLLM engine (the mla part
of bench/rollout_gpu.py compares the two MLA cache forms with one engine's routes replayed in the other)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

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
