"""Whole-turn state reuse vs stock vLLM prefix caching vs no caching: 8-turn episodes, real engine.

    python bench/rollout_reuse.py [--episodes 4 --turns 8 --prompt 1024 --obs 384 --gen 32]

A random-init model of the CPU preset (configs/model/cpu_tiny.yaml: 3 KDA : 1 gated MLA, latent MoE,
Block AttnRes) runs E concurrent episodes of T turns: a first prompt of P tokens, then per turn G
generated tokens (greedy, fixed length so every mode sees the same token stream) and a tool response
of O tokens wrapped in the chat template. The same episodes run on three engines:

* ``session``: our whole-turn reuse (resident vLLM streaming sessions: KV + KDA state kept);
* ``prefix_cache``: stock vLLM, full history each turn, block prefix caching (align mode);
* ``none``: full history each turn, no caching.

Printed per mode: prefill tokens actually computed per turn (from the engine's own step records)
vs the new tokens of that turn, the cached-token hit rate (context not recomputed), episode wall
time (engine start-up excluded; the modes' turns are interleaved so that a shared machine's load
drifts over all of them alike), ratios against ``none``, and whether all modes sampled identical
tokens. Each turn's row also splits its seconds into the engine's steps and the worker's own work
(``StepTimer``: step count, median and longest step).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("session", "prefix_cache", "none")
ROUTE_LOG_EPISODES = 4  # episodes whose engine routes a ModeRun keeps (bench/rollout_gpu.py's parity check)


def build_model(out: Path, preset: Path) -> None:
    import torch

    from model.config import HybridConfig
    from model.modeling import HybridForCausalLM
    from rollout.tokenizer import load_tokenizer

    torch.manual_seed(0)
    HybridForCausalLM(HybridConfig.from_yaml(preset)).save_pretrained(str(out))
    load_tokenizer().save_pretrained(str(out))


def episode_chunks(args, renderer) -> list[list[list[int]]]:
    """Per episode, per turn, the ids appended before sampling (first prompt, then observations)."""
    import random

    rng = random.Random(0)
    tool = lambda n: [rng.randrange(10, 1000) for _ in range(n)]
    eps = []
    for _ in range(args.episodes):
        first = renderer.render([{"role": "system", "content": "x"}], add_generation_prompt=False)
        first = (
            first
            + tool(args.prompt - len(first) - len(renderer.generation_prompt()))
            + renderer.generation_prompt()
        )
        turns = [first]
        for _ in range(args.turns - 1):
            # --obs-min: tool responses of obs_min..obs tokens (drawn per turn), else all of obs
            n_obs = rng.randint(args.obs_min, args.obs) if getattr(args, "obs_min", None) else args.obs
            obs = [
                renderer.im_end_id,
                *renderer.newline_ids,
                renderer.im_start_id,
                *renderer._text("tool\n"),
                renderer.special_ids["<tool_response>"],
                *tool(n_obs),
                renderer.special_ids["</tool_response>"],
                renderer.im_end_id,
                *renderer.newline_ids,
                *renderer.generation_prompt(),
            ]
            turns.append(obs)
        eps.append(turns)
    return eps


def warmup_prompts(chunks) -> list[list[int]]:
    """An engine's untimed warm-up: every episode's first prompt reversed, so the first turn's shapes (its
    batch of full-length prompts, prefill chunks, sequence lengths) have compiled and autotuned their kernels
    before any turn is timed, and no prefix is shared with what the episodes later send. With 256-token
    warm-up prompts, the first turn of the mode that ran first on the H200 took 2.80 s where the same turn of
    the mode after it (its kernels already compiled in the process) took 1.49 s."""
    return [c[0][::-1] for c in chunks]


FIRST_STEPS = 4  # StepTimer.summary lists the first steps of a turn in order


class StepTimer:
    """Times every ``step()`` of a ``SessionEngine`` while in use: a turn's seconds split into the engine's
    steps (scheduling, the forward, sampling, output processing) and the worker's own work around them
    (starting and finishing turns, the routing records). ``phases``: each step also split into the engine's
    host phases (``HostPhases``)."""

    def __init__(self, engine, profile_steps: int = 0, phases: bool = False) -> None:
        self.engine, self.ms = engine, []
        self.alloc0 = allocator_counts()
        self.jit0 = JIT_COMPILES.snapshot()
        self.profile_steps, self.host_top = profile_steps, []
        self.phases = HostPhases(engine.engine) if phases else None

    def __enter__(self) -> StepTimer:
        inner = self.engine.step

        def timed():
            prof = host_profiler() if len(self.ms) < self.profile_steps else None
            t0 = time.perf_counter()
            try:
                return inner() if prof is None else prof.runcall(inner)
            finally:
                self.ms.append((time.perf_counter() - t0) * 1e3)
                if prof is not None:
                    self.host_top.append(host_top(prof))
                if self.phases is not None:
                    self.phases.end_step()

        self.engine.step = timed
        if self.phases is not None:
            self.phases.install()
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step  # the class's method again
        if self.phases is not None:
            self.phases.remove()

    def summary(self, seconds: float) -> dict:
        ms = sorted(self.ms)
        in_steps = sum(ms) / 1e3
        return {"count": len(ms), "engine_s": round(in_steps, 4), "worker_s": round(seconds - in_steps, 4),
                "median_ms": round(ms[len(ms) // 2], 3) if ms else None, "max_ms": round(ms[-1], 3) if ms else None,
                # in order: a turn's prefill is its first step or two (one more with async scheduling)
                "first_ms": [round(x, 3) for x in self.ms[:FIRST_STEPS]],
                **({"host_top": self.host_top} if self.host_top else {}),
                **({"phases_ms": self.phases.summary(FIRST_STEPS)} if self.phases is not None else {}),
                **allocator_delta(self.alloc0, allocator_counts()), **JIT_COMPILES.since(self.jit0)}  # fmt: skip


# An engine step's host phases (vLLM 0.26 / 0.32 v1, an in-process engine core): label, the owner's path from the
# ``LLMEngine``, the method. Under async scheduling one ``step()`` schedules and launches step N + 1, then waits
# for step N's sampled tokens (``wait_tokens``: the sampler's device -> host copy, and the lists made of it) and
# hands them to the scheduler and the output processor; ``model_forward`` only launches on a GPU. Times are
# inclusive (``execute_model`` holds the runner's phases from ``update_states`` to ``compute_logits``).
_CORE = "engine_core.engine_core"
_RUNNER = f"{_CORE}.model_executor.driver_worker.worker.model_runner"
HOST_PHASES = (
    ("core_step", _CORE, "step_fn"),
    ("schedule", f"{_CORE}.scheduler", "schedule"),
    ("allocate_slots", f"{_CORE}.scheduler.kv_cache_manager", "allocate_slots"),
    ("execute_model", f"{_CORE}.model_executor", "execute_model"),
    ("update_states", _RUNNER, "_update_states"),
    ("prepare_inputs", _RUNNER, "_prepare_inputs"),
    ("batch_padding", _RUNNER, "_determine_batch_execution_and_padding"),
    ("slot_mappings", _RUNNER, "_get_slot_mappings"),
    ("attn_metadata", _RUNNER, "_build_attention_metadata"),
    ("preprocess", _RUNNER, "_preprocess"),
    ("model_forward", _RUNNER, "_model_forward"),
    ("record_step", f"{_RUNNER}._lh_recorder", "record"),  # ours: rollout.engine_hooks.StepRecorder
    ("compute_logits", f"{_RUNNER}.model", "compute_logits"),
    ("sample_tokens", f"{_CORE}.model_executor", "sample_tokens"),
    ("sample", _RUNNER, "_sample"),
    ("record_sampled", f"{_RUNNER}._lh_recorder", "record_sampled"),
    ("bookkeeping", _RUNNER, "_bookkeeping_sync"),
    ("wait_tokens", None, "get_output"),  # the runner's async output class (``_async_output_class``)
    ("update_from_output", f"{_CORE}.scheduler", "update_from_output"),
    ("process_outputs", "output_processor", "process_outputs"),
)


def _resolve(root, path: str | None):
    obj = root
    for name in path.split(".") if path else ():
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _async_output_class(llm_engine):
    """The class of the runner's asynchronous outputs (its ``get_output`` waits for the sampled tokens)."""
    runner = _resolve(llm_engine, _RUNNER)
    if runner is None:  # no runner in this process: nothing here would call it
        return None
    for mod in (sys.modules.get(type(runner).__module__), sys.modules.get("vllm.v1.worker.gpu_model_runner")):
        cls = getattr(mod, "AsyncGPUModelRunnerOutput", None)
        if cls is not None:
            return cls
    return None


class HostPhases:
    """Wall milliseconds of an engine step's host phases (``HOST_PHASES``), step by step: each phase's method
    wrapped with a timer while installed (instance attributes put back on ``remove``; the async output's class
    method likewise). A phase whose owner this engine lacks (an engine core in its own process, another vLLM)
    is listed in ``missing``. Times are inclusive: ``execute_model`` holds ``update_states``, ``prepare_inputs``
    and ``model_forward``."""

    _MISSING = object()

    def __init__(self, llm_engine) -> None:
        self.engine = llm_engine
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.saved: list[tuple[object, str, object]] = []
        self.missing: list[str] = []

    def _owner(self, path):
        return _async_output_class(self.engine) if path is None else _resolve(self.engine, path)

    def install(self) -> None:
        for label, path, name in HOST_PHASES:
            owner = self._owner(path)
            method = getattr(owner, name, None) if owner is not None else None
            if method is None:
                self.missing.append(label)
                continue
            before = getattr(owner, "__dict__", {}).get(name, self._MISSING)
            try:
                setattr(owner, name, self._timed(label, method))
            except (AttributeError, TypeError):  # an owner that takes no new attributes (slots, a frozen type)
                self.missing.append(label)
                continue
            self.saved.append((owner, name, before))

    def _timed(self, label: str, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[label] = self.current.get(label, 0.0) + (time.perf_counter() - t0) * 1e3

        return timed

    def remove(self) -> None:
        for owner, name, before in reversed(self.saved):
            if before is self._MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self.saved = []

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}

    def summary(self, skip: int) -> dict:
        """Per phase the median ms a step over the steps after the first ``skip`` (a turn's prefill), zero where
        a step did not enter it; ``missing`` the phases not found."""
        steps = self.steps[skip:]
        labels = [label for label, _, _ in HOST_PHASES if label not in self.missing]
        out = {label: round(statistics.median(s.get(label, 0.0) for s in steps), 3) for label in labels} if steps else {}
        return {**out, **({"missing": self.missing} if self.missing else {})}


HOST_TOP = 15  # functions a profiled step lists


def host_profiler():
    import cProfile

    return cProfile.Profile()


def host_top(prof) -> list[str]:
    """A cProfile'd step's ``HOST_TOP`` functions by time spent inside them and their callees, as
    "cumulative ms / own ms / calls  file:line(function)" (the profiler's overhead included)."""
    import pstats

    stats = pstats.Stats(prof).strip_dirs().sort_stats("cumulative")
    rows = []
    for func in stats.fcn_list[: HOST_TOP + 2]:
        _, calls, own, cum, _ = stats.stats[func]
        if func[2] in ("runcall", "timed"):  # the wrappers around the step
            continue
        rows.append(f"{cum * 1e3:.1f} / {own * 1e3:.1f} ms / {calls}  {func[0]}:{func[1]}({func[2]})")
    return rows[:HOST_TOP]


class JitCompiles:
    """Triton kernel variants compiled in this process (a JIT function's in-memory cache missed: a new
    specialisation of its arguments, e.g. an integer's divisibility by 16, or a new constexpr), by kernel, with
    the time each took (a hit in Triton's disk cache still takes milliseconds). Counted through Triton's
    ``knobs.runtime`` compile hooks, installed on first use, chained to hooks already there."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.ms = 0.0
        self._t0: float | None = None
        self.installed = False

    def install(self) -> bool:
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without knobs (before 3.4): nothing counted
            return False
        rt = knobs.runtime
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

        def pre(**kw):
            self._t0 = time.perf_counter()
            return before(**kw) if before else None  # a truthy answer skips the compile: only a hook before us

        def post(**kw):
            if self._t0 is not None:
                self.ms += (time.perf_counter() - self._t0) * 1e3
                self._t0 = None
            name = getattr(kw.get("fn"), "name", "?")
            self.count[name] = self.count.get(name, 0) + 1
            return after(**kw) if after else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
        self.installed = True
        return True

    def snapshot(self) -> tuple[dict[str, int], float] | None:
        return (dict(self.count), self.ms) if self.install() else None

    def since(self, snap: tuple[dict[str, int], float] | None) -> dict:
        """``{"jit": {"compiles": n, "ms": t, "kernels": {name: n}}}`` for the variants compiled since ``snap``."""
        if snap is None:
            return {}
        counts, ms = snap
        new = {k: n - counts.get(k, 0) for k, n in self.count.items() if n != counts.get(k, 0)}
        if not new:
            return {}
        return {"jit": {"compiles": sum(new.values()), "ms": round(self.ms - ms, 1), "kernels": new}}


JIT_COMPILES = JitCompiles()


# the caching allocators' counters a turn changes (on a GPU): device blocks created / returned, allocations retried
# after returning cached blocks (each synchronises the device), pinned host blocks created and the time in it (us)
ALLOC_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_host_alloc", "host_alloc_us")


def allocator_counts() -> dict[str, float] | None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    dev, host = torch.cuda.memory_stats(), torch.cuda.host_memory_stats()
    return {
        "num_device_alloc": dev.get("num_device_alloc", 0),
        "num_device_free": dev.get("num_device_free", 0),
        "num_alloc_retries": dev.get("num_alloc_retries", 0),
        "num_host_alloc": host.get("num_host_alloc", 0),
        "host_alloc_us": host.get("host_alloc_time.total", 0),
    }


def allocator_delta(before: dict | None, after: dict | None) -> dict:
    """``{"alloc": {counter: change}}`` for the counters that changed; nothing off a GPU."""
    if before is None or after is None:
        return {}
    changed = {k: after[k] - before[k] for k in ALLOC_COUNTERS if after[k] != before[k]}
    return {"alloc": changed} if changed else {}


class ModeRun:
    """One engine and the episodes' bookkeeping for one caching mode."""

    def __init__(self, mode: str, model_dir: Path, chunks, args) -> None:
        from rollout.worker import RolloutWorker, TurnRequest

        self.mode, self.chunks, self.args, self.TurnRequest = mode, chunks, args, TurnRequest
        self.worker = RolloutWorker(
            dict(
                model_path=str(model_dir),
                reuse=mode,
                max_model_len=args.max_model_len,
                max_num_seqs=max(8, args.episodes + 1),
                kv_cache_memory_bytes=args.kv_mib << 20,
                block_size=args.block_size,
                **getattr(args, "engine", {}),  # further WorkerConfig fields (bench/rollout_gpu.py: dtype, ...)
            )
        )
        warm = [
            TurnRequest(f"w{i}", p, max_tokens=4, temperature=0.0) for i, p in enumerate(warmup_prompts(chunks))
        ]
        self.worker.generate(warm)
        self.worker.end_sessions([r.session_id for r in warm])
        self.reps: list[list[dict]] = []
        self.tokens: dict[str, list] = {}

    def start_repeat(self, rep: int) -> None:
        """Fresh episodes (new session ids, empty prefix cache) for repetition ``rep``."""
        from envs.types import Episode

        self.worker.llm.reset_prefix_cache()
        self.sids = [f"e{i}r{rep}" for i in range(len(self.chunks))]
        self.context = dict.fromkeys(self.sids, 0)
        self.route_log = {s: Episode(s, "", "") for s in self.sids[:ROUTE_LOG_EPISODES]}  # None: no routes
        self.turns: list[dict] = []
        self.reps.append(self.turns)

    def turn(self, t: int) -> None:
        reqs = [
            self.TurnRequest(s, self.chunks[i][t], max_tokens=self.args.gen, temperature=0.0)
            for i, s in enumerate(self.sids)
        ]
        profiled = getattr(self.args, "profile_host_steps", 0) if len(self.reps) == 1 and t >= 2 else 0
        with StepTimer(self.worker.engine, profiled, getattr(self.args, "host_phases", False)) as steps:
            t0 = time.perf_counter()
            outs = self.worker.generate(reqs)
            dt = time.perf_counter() - t0
        self.last_logprobs = {s: o.logprobs for s, o in zip(self.sids, outs)}
        for s, r, o in zip(self.sids, reqs, outs):
            self.log_routes(s, r.token_ids, o)
        full = sum(self.context[s] + len(r.token_ids) for s, r in zip(self.sids, reqs))
        computed = sum(o.num_computed_prompt_tokens for o in outs)
        for i, (s, r, o) in enumerate(zip(self.sids, reqs, outs)):
            self.context[s] += len(r.token_ids) + len(o.token_ids)
            self.tokens.setdefault(f"{s}", []).append(o.token_ids)
            self.tokens.setdefault(f"e{i}", []).append(o.token_ids)
        self.record_turn(t, sum(len(r.token_ids) for r in reqs), full, computed, dt, steps.summary(dt))

    def log_routes(self, sid: str, chunk: list[int], out) -> None:
        """Keep ``sid``'s turn with the engine's routes (its new prompt ids, then its sampled ids; the previous
        turn's last sampled token gets the row recorded when it was fed, as rollout/episode.py does), for the
        first few episodes."""
        from envs.types import Turn

        ep = self.route_log.get(sid)
        if ep is None:
            return
        if out.prompt_routed_experts is None or out.routed_experts is None:
            self.route_log[sid] = None  # the engine recorded none: nothing to replay
            return
        if ep.turns and out.prev_token_routed_experts is not None:
            ep.turns[-1].routed_experts[-1] = out.prev_token_routed_experts
        ep.turns.append(Turn(chunk, list(out.token_ids), list(out.logprobs), routed_experts=out.routed_experts.copy(),
                             prompt_routed_experts=out.prompt_routed_experts))  # fmt: skip

    def history_routes(self, i: int):
        """[len(history(i)), L, K] int32: the engine's experts of each token of episode ``i`` (-1 where it
        recorded none, e.g. the last sampled token; laid out as the learner's batches are), or None without
        records."""
        from rl.batching import _routes

        ep = self.route_log.get(self.sids[i])
        return _routes(ep, len(ep.token_ids)) if ep and ep.turns else None

    def history(self, i: int) -> list[int]:
        """Episode ``i`` of the current repeat: its chunks and sampled tokens so far, in order."""
        return [t for chunk, out in zip(self.chunks[i], self.tokens[self.sids[i]]) for t in (*chunk, *out)]

    def record_turn(
        self, t: int, new: int, context: int, computed: int, seconds: float, steps: dict | None = None
    ) -> None:
        """Turn ``t``'s row: new tokens, the whole context, the prefill the engine computed, wall seconds, when
        it ended (Unix seconds: for lining turns up with a host's own logs), and where a ``ModeRun``'s seconds
        went (``StepTimer.summary``)."""
        self.turns.append(
            {"turn": t + 1, "new": new, "context": context, "computed": computed, "seconds": seconds,
             "ended_at": round(time.time(), 3),
             "hit_rate": 1 - computed / context, **({"steps": steps} if steps else {})}
        )  # fmt: skip

    def shutdown(self) -> None:
        self.worker.shutdown()

    def result(self) -> dict:
        self.shutdown()
        return {
            "mode": self.mode,
            "turns": self.turns,
            "wall_s": sum(x["seconds"] for x in self.turns),
            "tokens": self.tokens,
        }


class PlainRun(ModeRun):
    """The same episodes the way a user of a stock vLLM engine runs them: a plain ``vllm.LLM`` of
    ``model_dir`` (any model vLLM loads: bench/rollout_gpu.py gives it vLLM's native Kimi Linear, the
    ``peer`` mode), each turn the whole history submitted again with vLLM's prefix caching on, ``gen`` greedy
    tokens a turn (``ignore_eos``: every mode's turns the same length). Computed prefill per request: its
    prompt less the tokens vLLM served from the cache (``num_cached_tokens``). ``engine``: further ``LLM``
    arguments (dtype, GPU share, ``enforce_eager``, attention config)."""

    def __init__(self, mode: str, model_dir: Path, chunks, args, engine: dict | None = None) -> None:
        from vllm import LLM, SamplingParams

        from rollout.worker import count_in_process_engine

        self.mode, self.chunks, self.args = mode, chunks, args
        self.params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
        self.llm = LLM(
            model=str(model_dir), max_model_len=args.max_model_len, max_num_seqs=max(8, args.episodes + 1),
            kv_cache_memory_bytes=args.kv_mib << 20, enable_prefix_caching=True, seed=0, **(engine or {}),
        )  # fmt: skip
        # in this process (the bench's default), it shares the vLLM groups of the RolloutWorkers here
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        if self.in_process:
            count_in_process_engine()
        self.generate(warmup_prompts(chunks))  # untimed
        self.reps, self.tokens = [], {}

    def generate(self, prompts: list[list[int]]) -> list:
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)

    def start_repeat(self, rep: int) -> None:
        self.llm.reset_prefix_cache()
        self.sids = [f"e{i}r{rep}" for i in range(len(self.chunks))]
        self.history: list[list[int]] = [[] for _ in self.chunks]
        self.turns = []
        self.reps.append(self.turns)

    def turn(self, t: int) -> None:
        for hist, chunk in zip(self.history, self.chunks):
            hist.extend(chunk[t])
        t0 = time.perf_counter()
        outs = self.generate(self.history)
        dt = time.perf_counter() - t0
        full = sum(len(h) for h in self.history)
        computed = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outs)
        for i, (hist, o) in enumerate(zip(self.history, outs)):
            ids = list(o.outputs[0].token_ids)
            hist.extend(ids)
            self.tokens.setdefault(f"e{i}", []).append(ids)
        self.record_turn(t, sum(len(c[t]) for c in self.chunks), full, computed, dt)

    def shutdown(self) -> None:
        import gc

        from rollout.worker import shutdown_engine_core

        llm, self.llm = self.llm, None
        if llm is None:
            return
        shutdown_engine_core(llm.llm_engine.engine_core, self.in_process)
        del llm
        gc.collect()


def run_interleaved(modes: list[str], model_dir: Path, chunks, args) -> dict:
    """All engines up at once; turn t runs in every mode back to back, so the load of a shared
    machine drifts over all modes alike."""
    runs = [ModeRun(m, model_dir, chunks, args) for m in modes]
    for rep in range(args.repeats):
        for r in runs:
            r.start_repeat(rep)
        for t in range(args.turns):
            for r in runs:
                r.turn(t)
    return {r.mode: r.result() for r in runs}


def report(results: dict, args) -> str:
    lines = [
        f"episodes={args.episodes} turns={args.turns} prompt={args.prompt} obs={getattr(args, 'obs_min', None) or args.obs}..{args.obs} gen={args.gen} repeats={args.repeats} block_size={args.block_size or 'auto'}"
    ]
    base = results["none"]["wall_s"]
    lines.append(
        "mode          turn: computed/new (hit rate)  ...   | sum computed/new | turns>=2 computed/new | wall s | speedup vs none"
    )
    for mode in MODES:
        r = results[mode]
        cells = " ".join(f"{x['computed'] / x['new']:.2f}({x['hit_rate']:.0%})" for x in r["turns"])
        tot_c, tot_n = sum(x["computed"] for x in r["turns"]), sum(x["new"] for x in r["turns"])
        later_c = sum(x["computed"] for x in r["turns"][1:])
        later_n = sum(x["new"] for x in r["turns"][1:])
        lines.append(
            f"{mode:<13} {cells} | {tot_c / tot_n:.3f} | {later_c / later_n:.3f} | {r['wall_s']:.2f} | {base / r['wall_s']:.2f}x"
        )
    same = all(results[m]["tokens"] == results["none"]["tokens"] for m in MODES)
    lines.append(f"greedy tokens identical across modes: {same}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--obs", type=int, default=384)
    p.add_argument("--obs-min", type=int, default=None, help="tool responses of obs-min..obs tokens per turn")
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-mib", type=int, default=512)
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size of every engine (default: vLLM's pick, 128 here); prefix caching checkpoints "
        "the KDA state at block boundaries, so a small block approximates turn-boundary checkpoints",
    )
    p.add_argument("--preset", type=Path, default=ROOT / "configs/model/cpu_tiny.yaml")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=2, help="per-turn time = fastest repetition")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--host-phases", action="store_true",
                   help="each turn's steps split into the engine's host phases (HostPhases), in its steps.phases_ms")
    args = p.parse_args()
    from rollout.renderer import ChatRenderer

    with tempfile.TemporaryDirectory() as d:
        build_model(Path(d), args.preset)
        chunks = episode_chunks(args, ChatRenderer())
        results = run_interleaved(args.modes.split(","), Path(d), chunks, args)
    if set(results) == set(MODES):
        print(report(results, args))
    for m, r in results.items():
        print(
            m,
            json.dumps(
                [{k: round(v, 3) if isinstance(v, float) else v for k, v in x.items()} for x in r["turns"]]
            ),
        )
    if args.json:
        args.json.write_text(
            json.dumps({m: {k: v for k, v in r.items() if k != "tokens"} for m, r in results.items()})
        )


if __name__ == "__main__":
    main()
