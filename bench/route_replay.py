"""Expert routes replayed inside a vLLM engine: every MoE router of our model takes recorded experts.

bench/rollout_gpu.py's ``mla`` part compares the two MLA cache forms on greedy turns. At random init the
routers' top-k sets are near-tied somewhere in every long prompt (the k-th and (k+1)-th scores of 128
experts), so the last-bit differences between two attention forms flip a token's expert set and the two
engines part from there on, whatever the forms do. Replaying one engine's recorded routes in the other
takes routing out of the comparison: what is left is the attention forms themselves.

Two ways in. A device table inside the model (``LONGHORIZON_ROUTE_TABLE=1`` at engine construction,
``set_route_table`` below): the forward gathers each token's experts by position, so a compiled engine's
captured decode graphs take them too; bench/rollout_throughput.py's fast-path check uses it. And Python
hooks (``install_route_replay``), for an engine built without the table:

Functions sent with ``collective_rpc`` (module level; in-process engines). The replay is by absolute
position within ONE request per engine call: a hook on the vLLM model keeps the step's ``positions``
and a hook on the inner ``HybridModel`` passes ``routed_experts`` (the learner's own replay argument,
rows of -1 routed freely) for them. Eager engines only: the lookup runs in Python on every forward, which
a captured CUDA graph would skip.
"""

from __future__ import annotations

import numpy as np
import torch

from rollout.vllm_model import routes_at


class _Replay:
    """The two hooks of one replay and how many forwards they fed."""

    def __init__(self, model: torch.nn.Module, table_PLK: np.ndarray) -> None:
        device = next(model.parameters()).device
        self.table_PLK = torch.as_tensor(np.asarray(table_PLK), dtype=torch.long).to(device)
        self.positions_T: torch.Tensor | None = None
        self.forwards = 0
        self.handles = [
            model.register_forward_pre_hook(self._keep_positions, with_kwargs=True),
            model.model.register_forward_pre_hook(self._feed_routes, with_kwargs=True),
        ]

    def _keep_positions(self, _mod, args, kwargs):
        self.positions_T = kwargs["positions"] if "positions" in kwargs else args[1]

    def _feed_routes(self, _mod, args, kwargs):
        x = args[0] if args else kwargs.get("input_ids")
        if x is None:
            x = kwargs["inputs_embeds"]
        T = x.shape[0] * x.shape[1]
        if self.positions_T is None or self.positions_T.shape[0] != T:
            got = None if self.positions_T is None else tuple(self.positions_T.shape)
            raise RuntimeError(f"route replay: {T} tokens in the forward, positions {got}")
        self.forwards += 1
        return args, {**kwargs, "routed_experts": routes_at(self.table_PLK, self.positions_T.long())}

    def remove(self) -> int:
        for h in self.handles:
            h.remove()
        return self.forwards


def install_route_replay(worker, table_PLK: np.ndarray) -> bool:
    """collective_rpc: from now on every forward routes position p with ``table_PLK[p]`` ([P, L, K] expert
    ids per MoE layer; -1 rows route freely). One request per engine call."""
    runner = worker.model_runner
    remove_route_replay(worker)
    runner._lh_route_replay = _Replay(runner.get_model(), table_PLK)
    return True


def remove_route_replay(worker) -> int:
    """collective_rpc: hooks off; the number of forwards that were fed replayed routes."""
    runner = worker.model_runner
    replay = getattr(runner, "_lh_route_replay", None)
    runner._lh_route_replay = None
    return 0 if replay is None else replay.remove()


def set_route_table(worker, table_PLK: np.ndarray | None) -> bool:
    """collective_rpc: route position p of the next requests (one per call) with ``table_PLK[p]`` from the
    model's device table (``rollout.vllm_model``; the engine was built with ``LONGHORIZON_ROUTE_TABLE=1``);
    None routes freely again."""
    worker.model_runner.get_model().set_route_table(table_PLK)
    return True


class _Recorder:
    """Every forward's experts written into a [P, L, K] table at the tokens' positions (rows no forward
    reached stay -1). Hooks: a forward replayed from a captured CUDA graph records nothing."""

    def __init__(self, model: torch.nn.Module, positions: int) -> None:
        self.model, self.positions_T = model, None
        routed = model.routed_experts_TLK
        self.table_PLK = torch.full((positions, *routed.shape[1:]), -1, dtype=torch.long, device=routed.device)
        self.handles = [
            model.register_forward_pre_hook(self._keep_positions, with_kwargs=True),
            model.register_forward_hook(self._record),
        ]

    def _keep_positions(self, _mod, args, kwargs):
        self.positions_T = (kwargs["positions"] if "positions" in kwargs else args[1]).long()

    def _record(self, _mod, _args, _out):
        pos_T = self.positions_T
        inside_T = (pos_T >= 0) & (pos_T < self.table_PLK.shape[0])
        rows_TLK = self.model.routed_experts_TLK[: pos_T.shape[0]].long()
        self.table_PLK[pos_T[inside_T]] = rows_TLK[inside_T]

    def remove(self) -> np.ndarray:
        for h in self.handles:
            h.remove()
        return self.table_PLK.cpu().numpy()


def record_routes(worker, positions: int) -> bool:
    """collective_rpc: from now on record the experts of positions [0, positions) of the one request the
    engine runs (its prompt and generated tokens), until ``recorded_routes``."""
    runner = worker.model_runner
    recorded_routes(worker)
    runner._lh_route_recorder = _Recorder(runner.get_model(), positions)
    return True


def recorded_routes(worker) -> np.ndarray | None:
    """collective_rpc: the [positions, L, K] table ``record_routes`` filled (None if none), hooks off."""
    runner = worker.model_runner
    rec = getattr(runner, "_lh_route_recorder", None)
    runner._lh_route_recorder = None
    return None if rec is None else rec.remove()


# --- the greedy comparison of two engines, free and with one engine's routes replayed in the other ----------
def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the lists part (a shorter one parts where it ends); None when equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def _other_sets_PL(a_PLK: np.ndarray, b_PLK: np.ndarray) -> np.ndarray:
    """[P, L] True where the two expert sets differ (order within the top-k ignored); a row either side
    did not record (-1) counts as equal."""
    recorded_PL = (a_PLK >= 0).all(-1) & (b_PLK >= 0).all(-1)
    return (np.sort(a_PLK, -1) != np.sort(b_PLK, -1)).any(-1) & recorded_PL


def _routes_PLK(toks: list[int], routed, prompt_routed, upto: int | None = None) -> np.ndarray | None:
    """[P + A, L, K]: the experts of every position of a greedy turn (prompt, then generated tokens up to
    ``upto``; the last generated token's row is -1, it is fed only with a next turn)."""
    if routed is None or prompt_routed is None:
        return None
    return np.concatenate([prompt_routed, routed[: len(toks) if upto is None else upto]]).astype(np.int64)


def greedy_forms(test: dict, ref: dict) -> dict:
    """Greedy turns of two engines on the same prompts (bench/rollout_gpu.py ``probe``'s ``greedy``), routed
    freely: per prompt, whether the tokens are equal, the first differing token, and where the engines
    first chose another expert set (the first such position, prompt positions first; the share of
    (position, MoE layer) pairs with another set, over the positions both fed the same tokens)."""
    rows = []
    for prompt, t, r in zip(ref["greedy_prompts"], test["greedy"], ref["greedy"]):
        first = _first_difference(t[0], r[0])
        agree = len(t[0]) if first is None else first  # generated positions fed identical tokens on both
        a, b = _routes_PLK(t[0], t[2], t[3], agree), _routes_PLK(r[0], r[2], r[3], agree)
        row = dict(tokens_equal=first is None, first_token_mismatch=first, prompt_len=len(prompt))
        if a is not None and b is not None:
            other_PL = _other_sets_PL(a, b)
            where = np.flatnonzero(other_PL.any(-1))
            row["first_other_experts_position"] = int(where[0]) if where.size else None
            row["other_experts_share"] = float(other_PL.mean())
        rows.append(row)
    return dict(all_equal=all(r["tokens_equal"] for r in rows), rows=rows)


def replayed_greedy(worker, ref: dict, tag: str) -> dict:
    """``ref``'s greedy prompts on ``worker``, one request per call, every position routed to the experts
    ``ref``'s engine chose for it (prompt and generated tokens): per prompt, tokens equal to ``ref``'s, the
    first differing token, max |logprob difference| over the tokens before it, and whether the replay
    took effect (the engine recorded exactly the replayed experts, for every forward)."""
    from rollout.worker import TurnRequest

    rows = []
    for i, (prompt, greedy) in enumerate(zip(ref["greedy_prompts"], ref["greedy"])):
        toks, lps, routed, prompt_routed = greedy
        table_PLK = _routes_PLK(toks, routed, prompt_routed)
        if table_PLK is None:
            raise ValueError("the reference engine recorded no routes to replay")
        worker.llm.collective_rpc(install_route_replay, args=(table_PLK,))
        try:
            request = TurnRequest(f"{tag}{i}", prompt, max_tokens=len(toks), temperature=0.0)
            out = worker.generate([request])[0]
        finally:
            fed = worker.llm.collective_rpc(remove_route_replay)[0]
            worker.end_sessions([f"{tag}{i}"])
        first = _first_difference(out.token_ids, toks)
        agree = len(toks) if first is None else first
        got_PLK = _routes_PLK(out.token_ids, out.routed_experts, out.prompt_routed_experts)
        n = min(len(got_PLK), len(table_PLK)) if got_PLK is not None else 0
        applied = got_PLK is not None and not _other_sets_PL(got_PLK[:n], table_PLK[:n]).any()
        diffs = [abs(x - y) for x, y in zip(out.logprobs[:agree], lps[:agree])]
        rows.append(dict(tokens_equal=first is None, first_token_mismatch=first, forwards_fed=int(fed),
                         routes_applied=bool(applied), logprob_max_abs=max(diffs, default=0.0)))  # fmt: skip
    return dict(all_equal=all(r["tokens_equal"] for r in rows),
                routes_applied=all(r["routes_applied"] for r in rows), rows=rows)  # fmt: skip
