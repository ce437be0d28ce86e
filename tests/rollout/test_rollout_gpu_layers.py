"""bench/rollout_gpu.py on the CPU. The ``layers`` part: engine and learner recorded module by module on
one prefill, and a module broken on one side (from a given token on) named as the first to part, with
the token it starts at and the side that left the reference. The ``logprobs`` part's comparison with
the learner, routed freely and with the engine's routes of every fed token replayed."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.worker import TurnRequest

pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rollout_gpu.py"
CPU_RUN = SimpleNamespace(torch=torch, device=torch.device("cpu"), cuda=False)  # what learner_capture reads


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _perturb_from(module: torch.nn.Module, token: int):
    """A forward hook adding 0.5 to the module's output from ``token`` on (rows of [T, ...] or [1, T, ...])."""

    def hook(_mod, _inputs, out):
        y = out[0] if isinstance(out, tuple) else out
        y = y.clone()
        rows = y[0] if y.dim() >= 3 and y.shape[0] == 1 else y
        rows[token:] += 0.5
        return (y, *out[1:]) if isinstance(out, tuple) else y

    return module.register_forward_hook(hook)


def test_identical_sides_agree_and_every_kind_is_recorded(bench, tiny_ckpt):
    _, model = tiny_ckpt
    rows = bench.learner_capture(CPU_RUN, model, _prompt(0, 40), "fp32")
    res = bench.compare_layers(rows, rows, None, model.config, 1e-3)
    assert res["verdict"] == "agree" and res["first_parted"] is None
    kinds = {r["kind"] for r in res["rows"]}
    assert {"embed", "conv", "kda_output", "kda", "mla", "mla_attention", "moe_router", "moe", "moe_shared",
            "dense_mlp", "norm"} <= kinds  # fmt: skip


@pytest.mark.parametrize("broken", ["engine", "learner"])
def test_the_side_off_the_cpu_reference_is_named(bench, tiny_ckpt, broken):
    _, model = tiny_ckpt
    ids = _prompt(1, 40)
    ref = bench.learner_capture(CPU_RUN, model, ids, "fp32")
    bad_model = copy.deepcopy(model)
    _perturb_from(bad_model.model.layers[1].self_attn.k_conv1d, 17)
    bad = bench.learner_capture(CPU_RUN, bad_model, ids, "fp32")
    eng, lrn = (bad, ref) if broken == "engine" else (ref, bad)
    res = bench.compare_layers(eng, lrn, ref, model.config, 1e-3)
    first = res["first_parted"]
    assert first["name"] == "model.layers.1.self_attn.k_conv1d" and first["kind"] == "conv"
    assert first["first_bad_row"] == 17
    want = "engine wrong" if broken == "engine" else "learner (GPU) wrong"
    assert res["verdict"].startswith(f"{want} at model.layers.1.self_attn.k_conv1d")
    assert res["per_layer"].startswith("0:0e+00 1:")  # layer 0 untouched


def _capture_engine(bench, worker, prompts: list[list[int]]) -> dict[int, dict]:
    worker.llm.collective_rpc(bench.layers_capture_start)
    try:
        worker.generate(
            [TurnRequest(f"lay{i}", p, max_tokens=1, temperature=0.0) for i, p in enumerate(prompts)]
        )
    finally:
        captured = worker.llm.collective_rpc(bench.layers_capture_stop)[0]
        worker.end_sessions([f"lay{i}" for i in range(len(prompts))])
    return {rows["model.norm"].shape[0]: rows for rows in captured.values()}


def _break_in_engine(worker, token: int):
    def install(w):
        model = w.model_runner.get_model()
        return _perturb_from(model.model.layers[3].self_attn.kv_a_layernorm, token)

    return worker.llm.collective_rpc(install)[0]


def test_engine_rows_per_request_match_the_learner_and_a_broken_engine_module_is_named(
    bench, session_worker, tiny_ckpt
):
    _, model = tiny_ckpt
    prompts = [_prompt(2, 45), _prompt(3, 30)]  # one batch, told apart by length
    by_len = _capture_engine(bench, session_worker, prompts)
    assert sorted(by_len) == [30, 45]
    for p in prompts:
        res = bench.compare_layers(by_len[len(p)], bench.learner_capture(CPU_RUN, model, p, "fp32"), None,
                                   model.config, 1e-3)  # fmt: skip
        assert res["verdict"] == "agree", res["verdict"]
        assert res["modules"] >= 60  # every layer's modules, not a few
    handle = _break_in_engine(session_worker, 12)
    try:
        by_len = _capture_engine(bench, session_worker, prompts[:1])
    finally:
        handle.remove()
    res = bench.compare_layers(by_len[45], bench.learner_capture(CPU_RUN, model, prompts[0], "fp32"), None,
                               model.config, 1e-3)  # fmt: skip
    assert res["first_parted"]["name"] == "model.layers.3.self_attn.kv_a_layernorm"
    assert res["first_parted"]["kind"] == "mla" and res["first_parted"]["first_bad_row"] == 12
    assert all(r["rel"] < 1e-5 for r in res["rows"][: res["rows"].index(res["first_parted"])])


def test_compare_to_learner_replays_the_engines_routes_of_prompt_and_sampled_tokens(
    bench, session_worker, tiny_ckpt
):
    _, model = tiny_ckpt
    run = SimpleNamespace(
        **vars(CPU_RUN), args=SimpleNamespace(small=True), learner=lambda preset, seed=0: model
    )
    pr = bench.probe(run, session_worker, "tiny", "cmp")
    res = bench.compare_to_learner(run, pr, "tiny", "fp32")
    rep = res["replayed"]
    assert rep["tokens"] == res["tokens"] == 4 * 16 and rep["unrecorded_positions"] == 0
    assert res["mean_abs"] < 2e-5 and rep["mean_abs"] < 2e-5 and rep["kl_k3"] < 1e-9  # fp32: the same math
    # routes that are not the engine's, on the prompt tokens alone: only the replayed numbers move
    E = model.config.num_experts
    wrong = [(t, lp, r, (p + 1) % E) for t, lp, r, p in pr["sampled"]]
    bad = bench.compare_to_learner(run, {**pr, "sampled": wrong}, "tiny", "fp32")
    assert bad["mean_abs"] == res["mean_abs"]
    assert bad["replayed"]["mean_abs"] > 100 * max(rep["mean_abs"], 1e-6)
    kv = dict(attention_backends=["CPU_ATTN"], layout_bytes=1, vllm_real_bytes=1, vllm_allocated_bytes=1)
    check = dict(vs_learner=res, kv=kv, greedy_vs_generate={"all_equal": True}, first_call_s=1.0)
    table = bench.markdown({"logprobs": {"tiny/fp32": check}}).splitlines()
    header = next(x for x in table if x.startswith("| part |")).split(" | ")
    row = next(x for x in table if x.startswith("| logprobs |")).split(" | ")
    assert len(header) == len(row) and row[header.index("replayed mean abs")] == f"{rep['mean_abs']:.2e}"
    assert row[header.index("replayed KL k3")] == f"{rep['kl_k3']:.2e}"
    assert row[header.index("mean abs")] == f"{res['mean_abs']:.2e}"  # the free-routing columns stay


def test_reuse_summary_compares_the_turns_both_modes_ran_and_states_the_bar(bench):
    def rows(computed, seconds):
        return [dict(new=100, computed=c, seconds=s) for c, s in zip(computed, seconds)]

    turns = {
        "session": rows([100, 105, 104], [1.0, 0.5, 0.5]),
        "none": rows([100, 300, 500], [1.0, 2.0, 3.0]),
        "prefix_cache": rows([100, 180], [1.0, 1.0]),  # the budget ended it after two turns
    }
    s = bench.reuse_summary(turns)
    assert s["session"]["speedup_vs_none"] == 6.0 / 2.0 and s["prefix_cache"]["speedup_vs_none"] == 3.0 / 2.0
    assert s["session"]["later_computed_over_new"] == 209 / 200
    assert bench.reuse_bar(s, 3) == dict(complete=True, computed_within_1_1x=True, at_least_3x_vs_none=True)
    assert bench.reuse_bar(s, 8)["complete"] is False and bench.reuse_bar(s, 8)["at_least_3x_vs_none"] is None
    assert "speedup_vs_peer" not in s["session"]
    # the stock peer (vLLM's native model, history resubmitted with prefix caching): the engine issue's goal
    turns["peer"] = rows([100, 150, 200], [1.0, 1.5, 2.0])
    s = bench.reuse_summary(turns)
    assert s["session"]["speedup_vs_peer"] == 4.5 / 2.0 and s["prefix_cache"]["speedup_vs_peer"] == 2.5 / 2.0
