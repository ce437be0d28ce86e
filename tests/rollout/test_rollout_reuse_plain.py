"""bench/rollout_reuse.py's ``PlainRun`` on the CPU: the episodes the way a user of a stock vLLM engine runs
them (bench/rollout_gpu.py's ``peer`` mode, there with vLLM's native Kimi Linear): the whole history again
each turn with prefix caching on. Here it drives our tiny model, beside a live ``RolloutWorker`` that must
survive its shutdown (both share the process's vLLM groups)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rollout_cases import SMALL_ENGINE

pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rollout_reuse.py"


def test_plain_run_resubmits_the_history_and_prefix_caching_serves_it(bench, tiny_ckpt):
    from rollout.renderer import ChatRenderer
    from rollout.worker import RolloutWorker, TurnRequest

    path, _ = tiny_ckpt
    args = SimpleNamespace(episodes=2, turns=3, prompt=160, obs=40, obs_min=20, gen=6, max_model_len=768,
                           kv_mib=32, block_size=None)  # fmt: skip
    chunks = bench.episode_chunks(args, ChatRenderer())
    worker = RolloutWorker(dict(model_path=str(path), **SMALL_ENGINE))
    try:
        plain = bench.PlainRun("plain", path, chunks, args)
        plain.start_repeat(0)
        for t in range(args.turns):
            plain.turn(t)
        plain.shutdown()
        # the worker's engine still runs after the plain one is gone
        (out,) = worker.generate([TurnRequest("w", chunks[0][0][:32], max_tokens=3, temperature=0.0)])
        assert len(out.token_ids) == 3
    finally:
        worker.shutdown()
    rows = plain.turns
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert all(len(ids) == args.gen for ep in plain.tokens.values() for ids in ep)  # ignore_eos: fixed lengths
    assert rows[0]["computed"] == rows[0]["context"] == rows[0]["new"]  # nothing cached yet (warm-up prompts differ)
    for prev, r in pairwise(rows):
        assert r["context"] == prev["context"] + r["new"] + args.episodes * args.gen  # the whole history again
        # the cache serves what it holds of the history; the rest (new tokens, the last partial block and the
        # generated tokens before it) is computed
        assert r["new"] <= r["computed"] < r["context"] and 0 < r["hit_rate"] < 1


def test_warm_up_prompts_have_the_first_turns_lengths_and_not_its_prefixes(bench):
    """Every engine warms up on prompts as long as each episode's first one (the first timed turn then runs
    no shape for the first time), none of which starts as its episode's prompt does (nothing for the prefix
    cache to serve)."""
    from rollout.renderer import ChatRenderer

    args = SimpleNamespace(episodes=3, turns=2, prompt=300, obs=40, obs_min=20, gen=4)
    chunks = bench.episode_chunks(args, ChatRenderer())
    warm = bench.warmup_prompts(chunks)
    assert [len(w) for w in warm] == [len(c[0]) for c in chunks]
    assert all(w[:16] != c[0][:16] for w, c in zip(warm, chunks))


def test_mode_run_splits_each_turn_into_engine_steps_and_worker_time(bench, tiny_ckpt):
    """A session ``ModeRun`` times the engine's steps inside each turn (what bench/rollout_gpu.py logs to say
    where a reused turn's seconds go), with ``host_phases`` each step's host phases too, and leaves the engine's
    own methods in place afterwards."""
    from rollout.renderer import ChatRenderer
    from rollout.sessions import SessionEngine

    path, model = tiny_ckpt
    args = SimpleNamespace(episodes=2, turns=2, prompt=96, obs=24, obs_min=None, gen=5, max_model_len=512,
                           kv_mib=32, block_size=None, host_phases=True)  # fmt: skip
    run = bench.ModeRun("session", path, bench.episode_chunks(args, ChatRenderer()), args)
    try:
        llm_engine = run.worker.engine.engine
        timed = [(bench._resolve(llm_engine, path) if path else bench._async_output_class(llm_engine), name)
                 for _, path, name in bench.HOST_PHASES]  # fmt: skip
        before = [vars(owner).get(name) for owner, name in timed]  # None: the class's method
        run.start_repeat(0)
        for t in range(args.turns):
            run.turn(t)
        assert "step" not in vars(run.worker.engine)  # the timer removed itself
        assert type(run.worker.engine).step is SessionEngine.step
        # and the phases' timers theirs: the class's methods, or the recorder's wrappers, are back
        assert [vars(owner).get(name) for owner, name in timed] == before
        assert before.count(None) < len(before)  # the recorder's wrapper (the runner's _model_forward) among them
    finally:
        run.shutdown()
    for row in run.turns:
        phases = row["steps"]["phases_ms"]
        assert "missing" not in phases and set(phases) == {label for label, _, _ in bench.HOST_PHASES}
        assert phases["model_forward"] > 0 and phases["schedule"] > 0 and phases["process_outputs"] > 0
        # inclusive times: a step holds the scheduling, the forward and sampling; the forward its launch
        assert phases["core_step"] >= max(phases["schedule"], phases["execute_model"], phases["update_from_output"])
        assert phases["execute_model"] >= max(phases["prepare_inputs"], phases["model_forward"])
    # each episode's history and last-turn logprobs (bench/rollout_gpu.py's parity check reads them): the learner's
    for i, sid in enumerate(run.sids):
        history, last = run.history(i), run.tokens[sid][-1]
        assert len(history) == run.context[sid] and len(run.last_logprobs[sid]) == len(last) > 0
        with torch.no_grad():
            x = torch.tensor([history])
            out = model(x[:, :-1], target_ids=x[:, 1:], output_router_choices=True)
            ref = out.token_logprobs[0][len(history) - len(last) - 1 :]
        np.testing.assert_allclose(run.last_logprobs[sid], ref.numpy(), atol=2e-5)
        # the engine's experts of every fed token, across turns (the parity check replays them)
        routes = run.history_routes(i)
        assert routes.shape[0] == len(history) and (routes[-1] == -1).all() and (routes[:-1] >= 0).all()
        free = np.sort(out.router_choices.numpy(), -1)
        assert (np.sort(routes[:-1], -1) == free).all(-1).mean() > 0.99  # fp32: ties aside, the same experts
    for row in run.turns:
        steps = row["steps"]
        assert steps["count"] >= args.gen  # one step at least per generated token
        assert steps["engine_s"] > 0 and steps["worker_s"] >= 0
        assert steps["engine_s"] + steps["worker_s"] == pytest.approx(row["seconds"], abs=1e-3)
        assert 0 < steps["median_ms"] <= steps["max_ms"]


def test_a_turns_allocator_counters_are_the_changed_ones(bench):
    """The step summary's ``alloc`` entry: what a turn changed of the caching allocators' counters, nothing when
    none changed or off a GPU (``allocator_counts`` is None there)."""
    before = dict.fromkeys(bench.ALLOC_COUNTERS, 0) | {"num_device_alloc": 10, "host_alloc_us": 5.0}
    after = before | {"num_device_alloc": 13, "num_alloc_retries": 1}
    assert bench.allocator_delta(before, after) == {"alloc": {"num_device_alloc": 3, "num_alloc_retries": 1}}
    assert bench.allocator_delta(before, dict(before)) == {}
    assert bench.allocator_delta(None, after) == {} and bench.allocator_counts() is None  # this machine: no GPU


def test_jit_compiles_are_counted_by_kernel_through_tritons_hooks(bench, monkeypatch):
    """A turn's ``jit`` entry: the Triton kernel variants compiled during it, by kernel, timed from Triton's
    pre-compile hook to its post-compile hook; hooks already installed keep being called (a truthy answer of the
    earlier pre-compile hook, which skips the compile, passes through)."""
    from types import SimpleNamespace

    from triton import knobs

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append("pre") or False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append("post"))
    jit = bench.JitCompiles()
    snap = jit.snapshot()
    assert snap == ({}, 0.0) and jit.since(snap) == {}
    for name in ("_conv_fwd_state", "_conv_fwd_state", "kernel_unified_attention"):  # what Triton does per compile
        assert not knobs.runtime.jit_cache_hook(key=None, fn=SimpleNamespace(name=name))
        knobs.runtime.jit_post_compile_hook(key=None, fn=SimpleNamespace(name=name))
    got = jit.since(snap)["jit"]
    assert got["compiles"] == 3 and got["kernels"] == {"_conv_fwd_state": 2, "kernel_unified_attention": 1}
    assert got["ms"] >= 0 and calls == ["pre", "post"] * 3
    assert jit.since(jit.snapshot()) == {}  # nothing compiled since


def test_step_timer_profiles_the_first_steps_it_is_asked_to(bench):
    """``StepTimer(engine, profile_steps=2)`` (``--profile-host-steps``): the first two of three steps run under
    cProfile, each listed by its slowest functions with their cumulative and own ms; the third is only timed."""
    import time

    class Engine:
        def step(self):
            time.sleep(0.01)
            return []

    engine = Engine()
    with bench.StepTimer(engine, profile_steps=2) as steps:
        for _ in range(3):
            engine.step()
    summary = steps.summary(0.05)
    assert summary["count"] == 3 and len(summary["host_top"]) == 2
    top = summary["host_top"][0]
    assert 0 < len(top) <= bench.HOST_TOP and any("(step)" in row for row in top)
    assert not any("(runcall)" in row for row in top)
    assert "host_top" not in bench.StepTimer(engine).summary(0.0)


def test_host_phases_time_what_they_find_and_put_every_method_back(bench):
    """``HostPhases`` on an engine shaped as vLLM's (an in-process core): the phases it finds are timed step by step
    (inclusive: the core's step holds the scheduling), the ones whose owner is absent or takes no attribute are
    listed as missing, and ``remove`` leaves every owner as it was."""
    import time

    class Scheduler:
        __slots__ = ()  # takes no timer: "schedule" is missing

        def schedule(self):
            time.sleep(0.002)

    class Outputs:
        def process_outputs(self):
            time.sleep(0.001)

    sched, outputs = Scheduler(), Outputs()

    class Core:
        scheduler = sched

        def step_fn(self):
            sched.schedule()
            time.sleep(0.003)

    core = Core()
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core), output_processor=outputs)
    phases = bench.HostPhases(engine)
    phases.install()
    assert "step_fn" in vars(core) and "process_outputs" in vars(outputs)
    for _ in range(3):
        engine.engine_core.engine_core.step_fn()
        engine.output_processor.process_outputs()
        phases.end_step()
    phases.remove()
    assert "step_fn" not in vars(core) and "process_outputs" not in vars(outputs)
    summary = phases.summary(1)
    assert summary["core_step"] >= 5.0 and summary["process_outputs"] >= 1.0  # at least what they slept
    assert {"schedule", "execute_model", "wait_tokens", "update_from_output"} <= set(summary["missing"])
    assert "schedule" not in summary and "core_step" not in summary["missing"]
    assert bench.HostPhases(engine).summary(0) == {}  # no step timed
