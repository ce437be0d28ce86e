"""Where an engine's start-up and first call go: vLLM's own phase records, dynamo / inductor compile
seconds and Triton JIT compiles, gathered in the process that builds the engine.

``StartupProbe.install()`` (after ``import vllm``, which configures vLLM's logging) attaches a handler to
the ``vllm`` logger that keeps its INFO records with their time since install, whatever the console shows:
the logger itself is lowered to INFO and vLLM's own handlers are raised to the level the logger had, so a
run that exports ``VLLM_LOGGING_LEVEL=WARNING`` still prints only warnings. Seconds are read from the
messages vLLM logs at the end of its phases (``PHASES``; the raw timeline is kept as well, since message
texts move between vLLM versions). Triton JIT compiles are counted by a ``triton.knobs.compilation``
listener (in this process only: inductor's kernels compiled by its worker processes are not seen; their
time is inside dynamo's ``compile_times``). Our compiled regions' compiles and seconds, each region by name
(``model.compile.compile_record``), say which of them a slow start compiled for longest."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

# (key, pattern of a vLLM INFO message; group 1 holds seconds); a key seen several times is summed
PHASES = (
    ("weights_load_s", r"Loading weights took ([\d.]+) s"),
    ("model_load_s", r"Model loading took .*? and ([\d.]+) s"),
    ("dynamo_transform_s", r"Dynamo bytecode transform time: ([\d.]+) s"),
    ("graph_compile_s", r"Compiling a graph for .*? takes ([\d.]+) s"),
    ("graph_cache_load_s", r"Directly load the compiled graph.*? took ([\d.]+) s"),
    ("torch_compile_s", r"torch\.compile takes ([\d.]+) s in total"),
    ("profile_warmup_s", r"Initial profiling/warmup run took ([\d.]+) s"),
    ("memory_profiling_s", r"Memory profiling takes ([\d.]+) s"),
    ("cuda_graph_capture_s", r"Graph capturing finished in ([\d.]+) secs"),
    ("init_engine_s", r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
)
# dynamo's phases in the log line (nested: total > backend > codegen / load), label and compile_times key
DYNAMO_LINE = (
    ("total", "_compile.compile_inner"),
    ("tracing", "bytecode_tracing"),
    ("backend", "OutputGraph.call_user_compiler"),
    ("codegen", "GraphLowering.codegen"),
    ("load", "PyCodeCache.load_by_key_path"),
    ("async_wait", "async_compile.wait"),
)
MAX_RECORDS = 80  # timeline entries kept (the first ones: start-up)
MAX_CHARS = 240  # of a message (the engine's config line is thousands)


class StartupProbe(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.t0 = time.perf_counter()
        self.timeline: list[tuple[float, str]] = []
        self.phases: dict[str, float] = {}
        self.triton = {"compiles": 0, "cache_hits": 0, "compile_s": 0.0}

    def install(self) -> StartupProbe:
        self._attach()
        self._reattach_after_vllm_configures_logging()
        self._listen_triton()
        self.t0 = time.perf_counter()
        return self

    def _attach(self) -> None:
        logger = logging.getLogger("vllm")
        shown = logger.getEffectiveLevel()
        for h in logger.handlers:  # the console keeps showing what it showed
            if h is not self:
                h.setLevel(max(h.level, shown))
        logger.setLevel(min(shown, logging.INFO))
        if self not in logger.handlers:
            logger.addHandler(self)

    def _reattach_after_vllm_configures_logging(self) -> None:
        """Newer vLLMs (re)apply their logging ``dictConfig`` when the engine is built, which drops every
        handler of the ``vllm`` logger and resets its level: attach again right after."""
        try:
            import vllm.logger as vllm_logger
        except ImportError:
            return
        configure = getattr(vllm_logger, "_configure_vllm_root_logger", None)
        if configure is None or getattr(configure, "_startup_probe", False):
            return

        def configure_and_reattach(*args, **kwargs):
            out = configure(*args, **kwargs)
            self._attach()
            return out

        configure_and_reattach._startup_probe = True
        vllm_logger._configure_vllm_root_logger = configure_and_reattach

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a bad format in someone's record must not break the engine
            return
        t = time.perf_counter() - self.t0
        if len(self.timeline) < MAX_RECORDS:
            self.timeline.append((round(t, 2), msg[:MAX_CHARS]))
        for key, pattern in PHASES:
            m = re.search(pattern, msg)
            if m:
                self.phases[key] = round(self.phases.get(key, 0.0) + float(m.group(1)), 3)

    def _listen_triton(self) -> None:
        def on_compile(src, seconds: float, cache_hit: bool) -> None:
            self.triton["cache_hits" if cache_hit else "compiles"] += 1
            if not cache_hit:
                self.triton["compile_s"] = round(self.triton["compile_s"] + seconds, 3)

        listen_triton(on_compile)

    def snapshot(self, llm=None) -> dict[str, Any]:
        """Everything so far: vLLM's phases and timeline, its compilation_time, dynamo and Triton."""
        out: dict[str, Any] = {"vllm_phases": dict(self.phases), "compile": self.compile_snapshot()}
        if llm is not None:
            config = getattr(llm.llm_engine, "vllm_config", None)
            out["vllm_compilation_time_s"] = getattr(config, "compilation_config", None) and round(
                config.compilation_config.compilation_time, 3
            )
        out["vllm_log"] = list(self.timeline)
        return out

    def compile_snapshot(self) -> dict[str, Any]:
        from model.compile import compile_record

        return {"dynamo": dynamo_compile_times(), "triton_jit": dict(self.triton), "regions": compile_record()}


def listen_triton(on_compile) -> bool:
    """Call ``on_compile(src, seconds, cache_hit)`` for every Triton compile in this process (a
    ``triton.knobs.compilation`` listener, chained after any listener already set). False without Triton."""
    try:
        from triton import knobs
    except ImportError:
        return False
    previous = getattr(knobs.compilation, "listener", None)

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        on_compile(src, times.total / 1e6, cache_hit)
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener
    return True


def dynamo_compile_times() -> dict[str, float]:
    """torch._dynamo's accumulated compile seconds per phase (``compile_times(repr="csv", aggregate=True)``)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        seconds = {n: round(float(v), 3) for n, v in zip(names, values)}
        return {n: v for n, v in seconds.items() if v > 0}  # dozens of passes log 0.0
    except Exception as e:  # a private API: say so rather than fail the run
        return {"error": f"{type(e).__name__}: {e}"}


def _each(region: dict) -> str:
    """" [frame/compile seconds, ...]" of a region compiled more than once: a recompile or a graph break."""
    each = region.get("each") or []
    return f" [{', '.join(f'{cid} {sec:.1f}' for cid, sec in each)}]" if len(each) > 1 else ""


def breakdown_line(res: dict) -> str:
    """One line for the log: first call, vLLM's phases, dynamo's largest phases, Triton JIT."""
    st = res.get("startup") or {}
    phases = " ".join(f"{k[:-2]} {v:.1f}" for k, v in st.get("vllm_phases", {}).items())
    compile_ = res.get("compile_end") or st.get("compile") or {}
    comp = compile_.get("dynamo", {})
    dyn = " ".join(f"{label} {comp[k]:.1f}" for label, k in DYNAMO_LINE if isinstance(comp.get(k), float))
    tri = compile_.get("triton_jit", {})
    regions = compile_.get("regions") or {}
    top = ", ".join(f"{name} {r['compiles']} x {r['seconds']:.1f} s{_each(r)}" for name, r in list(regions.items())[:6])
    return (f"first call {res.get('first_call_s', float('nan')):.1f} s (engine init "
            f"{res.get('engine_init_s', float('nan')):.1f}); vLLM s: {phases or '-'}; dynamo s: {dyn or '-'}; "
            f"Triton JIT: {tri.get('compiles', 0)} compiles {tri.get('compile_s', 0.0):.1f} s, "
            f"{tri.get('cache_hits', 0)} cache hits; compiles by region: {top or '-'}")  # fmt: skip
