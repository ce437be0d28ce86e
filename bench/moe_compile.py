"""Where the engine's compiled MoE block spends its compile time, and what inductor's options change.

    python bench/moe_compile.py --out DIR [--variants base,triton_gmm,threads16,no_pointwise_autotune] [--preset gpu_1b]
    python bench/moe_compile.py --small --out DIR      # the plumbing on a CPU (cpu_tiny, inductor's C++)

The rollout engine compiles each MoE block whole (``model.compile`` scope "moe": router, routing, the route
layout, permutation, grouped GEMMs, combine, latent projections and shared expert; one graph shared by every
MoE layer). On the H200 that one compile was most of the engine's first call (bench/RESULTS.md, "Rollout
throughput"). This bench compiles that block alone, as the engine prepares it (``model.serving.
prepare_for_serving``: fused input GEMMs, the route layout counted over the engine's token budget; bf16, no
gradients, inference mode, the engine's inductor options), without vLLM, and calls it with the step sizes an
engine start goes through: vLLM's profile step (the token budget) and then each CUDA-graph capture size from
the largest down.

One child process per variant (``VARIANTS``: inductor options and compile workers), each with empty inductor
and Triton caches, so each pays a cold compile. Per variant: wall seconds of each call (the first one holds
the compile), compiles of the block and their seconds (``model.compile.compile_record``), dynamo's compile
phases, kernels inductor generated, and Triton binaries written to the variant's cache (kernels x the
configs compiled for each); then the compiled block's time per call at a decode size and a prefill size
against the eager block (and, on CUDA, per replay of the compiled call captured in a CUDA graph, as the
engine's decode steps run it), so an option that compiles faster is also seen not to run slower. Results go to
``DIR/moe_compile.json`` (rewritten after each variant) and one line per variant to the log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE_OPTIONS = {"emulate_precision_casts": True}  # what rollout.vllm_model compiles with
# name -> extra inductor options, compile workers (None: the engine's default), environment of the child
VARIANTS: dict[str, dict] = {
    "base": {},
    "threads16": {"threads": 16},
    "no_pointwise_autotune": {"options": {"triton.autotune_pointwise": False}},
    "no_autotune_t16": {"options": {"triton.autotune_pointwise": False}, "threads": 16},
    "serial": {"threads": 1},  # every Triton compile in this process: each kernel's compile seconds (``kernel_compiles``)
    # the expert GEMMs on our Triton grouped kernel instead of torch's CUTLASS one (kernels.moe.GROUPED_MM)
    "triton_gmm": {"env": {"LONGHORIZON_GROUPED_MM": "triton"}},
}
STEP_TOKENS = 16384  # vLLM's default token budget on an H200: the profile step
CAPTURE_SIZES = (128, 64, 32, 16, 8, 4, 2)  # the engine's CUDA-graph sizes, captured largest first
TIMED = ((64, 200), (4096, 20))  # (tokens, calls) for the steady-state time per call


def child(spec: dict) -> dict:
    import torch

    from bench.startup_probe import dynamo_compile_times
    from model.compile import compile_record, compile_regions
    from model.serving import inductor_compile_threads, prepare_for_serving

    small = spec["small"]
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.bfloat16
    threads = inductor_compile_threads(None if spec["threads"] is None else str(spec["threads"]), device.type == "cuda")
    kernels = listen_triton_compiles()
    moe = build_block(spec["preset"], small).to(device, dtype)
    prepare_for_serving(moe, spec["step_tokens"])
    eager_fn = moe.forward_fn
    regions = compile_regions(moe, "inductor", options={**ENGINE_OPTIONS, **spec["options"]}, scope="moe")
    compiled_fn, D = moe.forward_fn, moe.gate.weight.shape[1]
    out: dict = {"variant": spec["name"], "options": spec["options"], "compile_threads": threads, "calls": []}
    t_start = time.perf_counter()
    with torch.inference_mode():
        for T in (spec["step_tokens"], *spec["capture_sizes"]):
            x = torch.randn(1, T, D, device=device, dtype=dtype)
            t0 = time.perf_counter()
            moe(x, None, True)
            sync(device)
            out["calls"].append((T, round(time.perf_counter() - t0, 3)))
        out["compile_wall_s"] = round(time.perf_counter() - t_start, 3)
        out["regions"] = compile_record()
        out["dynamo"] = dynamo_compile_times()
        out["kernels_generated"] = inductor_kernel_count()
        out["triton_binaries"] = count_binaries(os.environ.get("TRITON_CACHE_DIR"))
        out["failed"] = [r.name for r in regions if r.failed]
        out["kernel_compiles"] = sorted(kernels, key=lambda kv: -kv[1])[:30]
        out["per_call_ms"] = {}
        for T, n in spec["timed"]:
            x = torch.randn(1, T, D, device=device, dtype=dtype)
            compiled_ms = time_calls(lambda x=x: moe(x, None, True), n, device)
            graph_ms = time_graph_replays(lambda x=x: moe(x, None, True), n, device)
            moe.forward_fn = eager_fn
            eager_ms = time_calls(lambda x=x: moe(x, None, True), n, device)
            moe.forward_fn = compiled_fn
            out["per_call_ms"][T] = {"compiled": compiled_ms, "eager": eager_ms, "compiled_graph": graph_ms}
    return out


def build_block(preset: str, small: bool):
    """One MoE block of the preset, random init with router logits of std ~3 (bench/rollout_gpu.py's init)."""
    from bench.rollout_gpu import _random_init, preset_config
    from model.moe import SparseMoE

    return _random_init(preset_config("tiny" if small else preset, False), 0, SparseMoE)


def listen_triton_compiles() -> list[tuple[str, float]]:
    """(kernel name, compile seconds) of each Triton compile in this process, appended as they happen (inductor's
    worker processes compile out of sight: the "serial" variant has none)."""
    from bench.startup_probe import listen_triton

    seen: list[tuple[str, float]] = []

    def on_compile(src, seconds: float, cache_hit: bool) -> None:
        if not cache_hit:
            name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
            seen.append((str(name), round(seconds, 3)))

    listen_triton(on_compile)
    return seen


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, n: int, device) -> float:
    """Milliseconds per call over ``n`` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return round((time.perf_counter() - t0) / n * 1e3, 4)


def time_graph_replays(fn, n: int, device) -> float | None:
    """Milliseconds per replay of ``fn`` captured in a CUDA graph (the engine's decode steps run so: the
    block's GPU time without the host's launches); None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    fn()  # warm: nothing may compile inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_calls(graph.replay, n, device)


def inductor_kernel_count() -> int | None:
    try:
        from torch._inductor import metrics

        return int(metrics.generated_kernel_count)
    except Exception:  # a private counter: a torch without it
        return None


def count_binaries(cache_dir: str | None) -> int | None:
    """Triton kernels compiled into ``cache_dir``: one GPU binary (.cubin / .hsaco) per kernel and config."""
    if not cache_dir or not os.path.isdir(cache_dir):
        return None
    return sum(1 for _, _, files in os.walk(cache_dir) for f in files if f.endswith((".cubin", ".hsaco")))


def run_variant(spec: dict, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="moe_compile_") as tmp:
        env = {**os.environ, **spec["env"]}
        env.update(TRITON_CACHE_DIR=f"{tmp}/triton", TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor",
                   TORCH_LOGS=env.get("TORCH_LOGS", "recompiles,graph_breaks"),
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))  # fmt: skip
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path), "--child-out", str(out_path)],
                              env=env, timeout=spec["timeout_s"], capture_output=True, text=True)  # fmt: skip
        tail = (proc.stdout + proc.stderr)[-3000:]
        if proc.returncode != 0 or not out_path.exists():
            log(f"[{spec['name']}] failed (exit {proc.returncode}):\n{tail}")
            return {"variant": spec["name"], "error": tail}
        res = json.loads(out_path.read_text())
        res["process_s"] = round(time.perf_counter() - t0, 1)
        res["log_tail"] = tail
        return res


def summary(res: dict) -> str:
    if "error" in res:
        return f"{res['variant']}: failed"
    block = next(iter(res["regions"].values()), {})
    dyn = res["dynamo"]
    times = ", ".join(f"{ms['compiled']:.3f} / {ms['eager']:.3f} ms at {T} (in a CUDA graph {ms['compiled_graph']})"
                      for T, ms in res["per_call_ms"].items())  # fmt: skip
    return (f"{res['variant']}: calls {res['calls'][:3]}...; compile wall {res['compile_wall_s']:.1f} s, block "
            f"{block.get('compiles')} x {block.get('seconds', 0):.1f} s {block.get('each')}; kernels "
            f"{res['kernels_generated']}, Triton binaries {res['triton_binaries']}; dynamo backend "
            f"{dyn.get('OutputGraph.call_user_compiler', 0):.1f} s, load {dyn.get('PyCodeCache.load_by_key_path', 0):.1f}"
            f" s, async wait {dyn.get('async_compile.wait', 0):.1f} s; compiled / eager per call: {times}; slowest "
            f"Triton compiles in the process: {res.get('kernel_compiles', [])[:6]}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=False)
    ap.add_argument("--variants", default="base,threads16,no_pointwise_autotune")
    ap.add_argument("--preset", default="gpu_1b")
    ap.add_argument("--small", action="store_true", help="cpu_tiny on the CPU (plumbing)")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per variant")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = child(json.loads(args.child.read_text()))
        args.child_out.write_text(json.dumps(res))
        return 0
    if args.out is None:
        ap.error("--out is required")
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "moe_compile.log"

    def log(msg: str) -> None:
        print(msg, flush=True)
        with log_path.open("a") as f:
            f.write(msg + "\n")

    results = []
    for name in names:
        variant = VARIANTS[name]
        spec = {"name": name, "options": variant.get("options", {}), "threads": variant.get("threads"),
                "env": variant.get("env", {}), "preset": args.preset, "small": args.small,
                "step_tokens": 256 if args.small else STEP_TOKENS,
                "capture_sizes": CAPTURE_SIZES[-3:] if args.small else CAPTURE_SIZES,
                "timed": ((8, 5), (64, 3)) if args.small else TIMED, "timeout_s": args.timeout_s}  # fmt: skip
        try:
            res = run_variant(spec, log)
        except subprocess.TimeoutExpired:
            res = {"variant": name, "error": f"timed out after {args.timeout_s:.0f} s"}
        results.append(res)
        log(summary(res))
        (args.out / "moe_compile.json").write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
