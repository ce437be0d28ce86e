"""Routing replay records of every token the engine computed, prompt tokens included: the worker's
per-turn records (rollout/worker.py) carried by the episode loop (rollout/episode.py) into the learner
batch row (rl/batching.py), against the learner's own router on the same tokens (CPU, fp32, the tiny
model, whose router scores are spread so that top-k choices are no near-ties)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from envs.types import Episode
from rl.batching import episode_row
from rollout.episode import EpisodeBudget, EpisodeRun, SamplingConfig
from rollout.renderer import ChatRenderer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def renderer():
    return ChatRenderer()


@pytest.fixture(scope="module")
def prefix_worker(tiny_ckpt):
    from rollout_cases import SMALL_ENGINE

    from rollout.worker import RolloutWorker

    w = RolloutWorker(dict(model_path=str(tiny_ckpt[0]), reuse="prefix_cache", **SMALL_ENGINE))
    yield w
    w.shutdown()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _episode(worker, renderer, eid: str, chunks: list[list[int]]) -> Episode:
    """One turn per chunk through the real episode loop (the chunks stand in for the rendered opening
    and the observations), sampled at temperature 1."""
    budget = EpisodeBudget(max_turns=len(chunks), max_tokens_per_turn=6, max_episode_tokens=700)
    run = EpisodeRun(None, renderer, budget, SamplingConfig(temperature=1.0), episode_id=eid)
    for chunk in chunks:
        run.pending_ids = list(chunk)
        out = worker.generate([run.next_request()])[0]
        assert run.on_output(out) is not None, out.finish_reason
    worker.end_sessions([eid])
    return run.episode


def _learner_routes(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]), output_router_choices=True).router_choices.numpy()  # [T, L, K]


def _assert_equal_where_recorded(routes: np.ndarray, ref: np.ndarray) -> None:
    rec = (routes >= 0).all((1, 2))
    assert ((routes >= 0).all((1, 2)) | (routes < 0).all((1, 2))).all()  # a token is recorded whole or not
    np.testing.assert_array_equal(np.sort(routes[rec], -1), np.sort(ref[rec], -1))


def test_session_episode_routes_every_position_as_the_learner_does(session_worker, renderer, tiny_ckpt):
    _, model = tiny_ckpt
    ep = _episode(session_worker, renderer, "rr", [_prompt(40, 50), _prompt(41, 12)])
    assert (
        ep.turns[1].num_computed_prompt_tokens == 12 + 1
    )  # session reuse: only the new ids (+ the carried one)
    row = episode_row(ep, [0.0, 0.0])
    routes = row.routed_experts
    assert routes.shape[0] == len(ep.token_ids)
    # every token the engine fed has its routes, the turn boundaries included; the episode's last
    # sampled token was never fed (its routes would change only the logits after it, read by no loss)
    assert (routes[:-1] >= 0).all() and (routes[-1] == -1).all()
    ref = _learner_routes(model, ep.token_ids)
    _assert_equal_where_recorded(routes[:-1], ref[:-1])
    # replaying them in the learner computes what free routing computes (fp32, no near-ties)
    x = torch.tensor([ep.token_ids])
    with torch.no_grad():
        free = model(x[:, :-1], target_ids=x[:, 1:]).token_logprobs
        replayed = model(
            x[:, :-1], target_ids=x[:, 1:], routed_experts=torch.from_numpy(routes[:-1])
        ).token_logprobs
    torch.testing.assert_close(replayed, free, atol=1e-6, rtol=0)


def test_prefix_cache_hits_of_another_episode_stay_unrecorded_own_hits_keep_earlier_records(
    prefix_worker, renderer, tiny_ckpt
):
    """Stock prefix caching: a prefix served from the cache is not computed in that turn. Served from
    the episode's own earlier turn, its positions keep what that turn recorded; served from another
    request (here a second episode with the same opening), this episode never computed them: -1."""
    _, model = tiny_ckpt
    block = prefix_worker.llm.llm_engine.vllm_config.cache_config.block_size
    first = _prompt(42, 2 * block + 44)
    a = _episode(prefix_worker, renderer, "pa", [first, _prompt(43, 20)])
    b = _episode(prefix_worker, renderer, "pb", [first, _prompt(44, 20)])

    def hit(ep: Episode, t: int) -> int:  # prompt tokens of turn t served from the cache
        before = sum(len(x.prompt_token_ids) + len(x.token_ids) for x in ep.turns[:t])
        return before + len(ep.turns[t].prompt_token_ids) - ep.turns[t].num_computed_prompt_tokens

    assert hit(a, 0) == 0 and hit(a, 1) >= block  # a's second turn: its own first turn's blocks
    assert hit(b, 0) >= block and hit(b, 0) % block == 0  # b's first turn: a's blocks
    for ep, unrecorded in ((a, 0), (b, hit(b, 0))):
        routes = episode_row(ep, [0.0, 0.0]).routed_experts
        assert (routes[:unrecorded] == -1).all()
        assert (routes[unrecorded:-1] >= 0).all() and (routes[-1] == -1).all()
        _assert_equal_where_recorded(routes[:-1], _learner_routes(model, ep.token_ids)[:-1])


def test_turn_routes_are_looked_up_by_position_and_a_recomputed_one_keeps_its_last_record():
    """The worker's lookup of a turn's rows in its step records (rollout.worker._routed_rows), on hand-made
    records: an earlier position recomputed by a fallback is not returned, a position computed twice keeps
    its last record, the last sampled token (not fed yet) is -1, the previous turn's last token is found."""
    from rollout.engine_hooks import RequestRecord
    from rollout.worker import _routed_rows

    def rows(values):  # [n, L=2, K=3], every expert slot of token i holding values[i]
        return np.broadcast_to(np.array(values, np.int16)[:, None, None], (len(values), 2, 3)).copy()

    # prompt ids at 4..6 (prompt_len 7), sampled tokens at 7..8, the previous turn's last token at 3
    rec = RequestRecord(
        num_computed_tokens=7,
        positions=[np.array([2, 3, 4, 5, 6]), np.array([5, 7])],
        routed=[rows([20, 30, 40, 50, 60]), rows([51, 70])],
    )
    prompt, sampled, prev = _routed_rows(rec, prompt_len=7, num_prompt=3, num_sampled=2, prev_pos=3)
    np.testing.assert_array_equal(prompt, rows([40, 51, 60]))
    np.testing.assert_array_equal(sampled, rows([70, -1]))
    np.testing.assert_array_equal(prev, rows([30])[0])
    assert sampled.dtype == prompt.dtype == np.int16
    assert _routed_rows(rec, 7, 3, 2, prev_pos=-1)[2] is None  # a first turn has no previous token
    assert _routed_rows(rec, 7, 3, 2, prev_pos=1)[2] is None  # not computed in this turn
