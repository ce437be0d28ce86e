"""KDA kernel benchmark on a GPU: our Triton `chunk_kda_triton` against flash-linear-attention.

First checks correctness on the GPU (against the float64 reference on a short prefix at the real head
counts, and against FLA's output and gradients at every timed shape), then times forward and
forward+backward for each shape against FLA's `chunk_kda(safe_gate=True, lower_bound=-5)` (the peer)
and its unbounded-gate path (`safe_gate=False`), all in one process. Prints ms, forward TFLOP/s
(per head 6*T*d^2 + 3*T*C*d + T*C^2), the fraction of the memory roofline (bytes of q, k, v, g, beta in
and o out over the measured copy bandwidth) and the ratio FLA time / our time (> 1 means we are faster).

Triton autotuning and compilation dominate a cold start (FLA's autotune keys include the head count),
so `--warm` first compiles every (implementation, head count, varlen) combination in parallel
processes on the many host cores; FLA keeps its autotune picks in Triton's cache (FLA_CACHE_RESULTS=1),
where the timing process finds them. Cold, FLA's tuning at the five shapes took more than 6 minutes
of an H200; `bench/assets/fla-0.6.0_triton-3.6_h200_autotune.tgz` holds the picks it made there
(fla-core 0.6.0, triton 3.6.0, the Triton autotune-cache files), which cuts the warm-up to about 30 s:

    export TRITON_CACHE_DIR=/tmp/tc; mkdir -p $TRITON_CACHE_DIR
    tar xzf bench/assets/fla-0.6.0_triton-3.6_h200_autotune.tgz -C $TRITON_CACHE_DIR
    python bench/kda_kernel.py --out OUT [--shapes s1,s2,s3,s4,v] [--impls ours,fla_safe,fla_unb] [--warm]

(Other versions or GPUs simply miss that cache and tune afresh.) Our kernels compile one launch config
each by default (`kernels/kda/triton/launch.py`: on an H200 the picks its autotuner made at gpu_1b's
shapes); the tables in bench/RESULTS.md were measured with the whole search, which
`LONGHORIZON_KDA_AUTOTUNE=1` restores for this benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("FLA_CACHE_RESULTS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

C = 64  # chunk length in the FLOP count
DEVICE = "cuda"  # "cpu" with --smoke: runs the plumbing under TRITON_INTERPRET at toy sizes
DTYPE = torch.bfloat16


@dataclass
class Shape:
    name: str
    B: int
    T: int
    H: int
    D: int = 128
    varlen: int = 0  # number of equal packed sequences (B = 1), 0 = fixed length

    @property
    def tokens(self) -> int:
        return self.B * self.T

    def label(self) -> str:
        return (
            f"varlen {self.varlen} x {self.T // self.varlen}, H={self.H}"
            if self.varlen
            else f"{self.B} x {self.T}, H={self.H}"
        )


SHAPES = {
    "s1": Shape("s1", 1, 8192, 16),
    "s2": Shape("s2", 1, 8192, 96),
    "s3": Shape("s3", 4, 4096, 32),
    "s4": Shape("s4", 1, 65536, 16),
    "v": Shape("v", 1, 8192, 32, varlen=8),
}


@dataclass
class Report:
    env: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "kda_bench.json").write_text(json.dumps(asdict(self), indent=1))


def make_inputs(shape: Shape, seed: int = 0, requires_grad: bool = True):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    B, T, H, D = shape.B, shape.T, shape.H, shape.D
    rand = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)
    q = torch.nn.functional.normalize(rand(B, T, H, D), dim=-1).to(DTYPE)
    k = torch.nn.functional.normalize(rand(B, T, H, D), dim=-1).to(DTYPE)
    v = rand(B, T, H, D).to(DTYPE)
    g = -5.0 * torch.sigmoid(rand(B, T, H, D) + 1.0)  # the bounded gate, fp32 as the model makes it
    beta = torch.sigmoid(rand(B, T, H)).to(DTYPE)
    ins = [q, k, v, g, beta]
    if requires_grad:
        ins = [x.requires_grad_() for x in ins]
    cu = None
    if shape.varlen:
        cu = torch.arange(0, T + 1, T // shape.varlen, device=DEVICE, dtype=torch.int64)
    return ins, cu


def impl_fn(name: str):
    """(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens) -> (o, ht) for each contender."""
    if name.startswith("ours"):
        from kernels.kda.triton import chunk_kda_triton

        # ours = the default intra precision; ours_bf16 / ours_tf32 / ours_bf16x3: that precision
        prec = name.split("_")[1] if "_" in name else None

        def ours(q, k, v, g, b, h0, fs, cu):
            if prec is None:
                os.environ.pop("LONGHORIZON_KDA_INTRA_PREC", None)
            else:
                os.environ["LONGHORIZON_KDA_INTRA_PREC"] = prec
            return chunk_kda_triton(q, k, v, g, b, initial_state=h0, output_final_state=fs, cu_seqlens=cu)

        return ours
    from fla.ops.kda import chunk_kda

    safe = name == "fla_safe"
    return lambda q, k, v, g, b, h0, fs, cu: chunk_kda(
        q, k, v, g, b, initial_state=h0, output_final_state=fs, cu_seqlens=cu,
        safe_gate=safe, lower_bound=-5.0 if safe else None,
    )  # fmt: skip


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    got, ref = got.double(), ref.double()
    scale = ref.abs().max().clamp_min(1e-12)
    return {
        "max_rel": float((got - ref).abs().max() / scale),
        "rms_rel": float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)),
        "finite": bool(torch.isfinite(got).all()),
    }


def run_fwd_bwd(fn, ins, cu, h0, seed=1):
    """Outputs and grads (q, k, v, g, beta, h0) for fixed random output gradients."""
    o, ht = fn(*ins, h0, True, cu)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    do = torch.randn(o.shape, device=DEVICE, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device=DEVICE, generator=gen)
    wrt = [*ins, h0]
    grads = torch.autograd.grad([o, ht], wrt, [do, dht])
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    return {"o": o.detach(), "ht": ht.detach()} | dict(zip(names, grads))


def check_against_reference(report: Report, impls: list[str], H: int, T: int, varlen: bool) -> None:
    """Float64 recurrence on a short prefix at the real head count; every tensor's relative error."""
    from kernels.kda.naive import naive_recurrent_kda

    shape = Shape("prefix", 1, T, H, D=128 if DEVICE == "cuda" else 16, varlen=4 if varlen else 0)
    ins, cu = make_inputs(shape, seed=2)
    if varlen:  # uneven, with a chunk boundary straddled and one sub-chunk sequence
        mid = max(38, T * 25 // 64)
        cu = torch.tensor([0, 37, mid, mid + 1, T], device=DEVICE, dtype=torch.int64)
    N = 1 if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, shape.D, shape.D, device=DEVICE).mul_(0.1).requires_grad_()
    naive = lambda q, k, v, g, b, h0, fs, cu: naive_recurrent_kda(
        q.double(), k.double(), v.double(), g.double(), b.double(), initial_state=h0.double(),
        output_final_state=fs, cu_seqlens=cu,
    )  # fmt: skip
    ref = run_fwd_bwd(naive, ins, cu, h0)
    for name in impls:
        got = run_fwd_bwd(impl_fn(name), ins, cu, h0)
        errs = {key: rel_errors(got[key], ref[key]) for key in ref}
        report.checks.append(
            {"kind": "vs float64 reference", "impl": name, "H": H, "T": T, "varlen": varlen, "errors": errs}
        )
        worst = max(e["rms_rel"] for e in errs.values())
        print(f"[check] {name:8s} H={H} T={T} varlen={varlen}: worst rms_rel {worst:.2e}  "
              + " ".join(f"{k}={e['rms_rel']:.1e}/{e['max_rel']:.1e}" for k, e in errs.items()), flush=True)  # fmt: skip
    del ref
    sync()


def do_bench(fn, warmup=25, rep=100) -> float:
    if DEVICE == "cpu":  # smoke mode: one call, wall clock
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def check_decode(report: Report, N: int = 64, H: int = 32, D: int = 128) -> None:
    """`kernels.kda.kda_decode_step_` on the device (the Triton step, in place on a paged pool) against
    its CPU path, one token per sequence with a padding entry; then timed against the PyTorch step on
    the same device tensors (what ran there before the dispatch)."""
    from kernels.kda import kda_decode_step_
    from kernels.kda.recurrent import _pool_step_

    if DEVICE == "cpu":
        N, H, D = 3, 2, 16
    P = N + N // 2
    gen = torch.Generator(device="cpu").manual_seed(7)
    rand = lambda *s: torch.randn(*s, generator=gen)
    q, k = (torch.nn.functional.normalize(rand(N, H, D), dim=-1) for _ in range(2))
    v, g, beta = rand(N, H, D), -5.0 * torch.sigmoid(rand(N, H, D) + 1), torch.sigmoid(rand(N, H))
    pages = rand(P, H * D * D + 3 * H * D * 3) * 0.1  # conv states beside each slot's recurrent state
    slots = torch.randperm(P, generator=gen)[:N]
    slots[N // 3] = -1
    ins_cpu = [x.to(DTYPE) for x in (q, k, v)] + [g, beta.to(DTYPE)]
    ins_dev = [x.to(DEVICE) for x in ins_cpu]
    pool = lambda pg: pg[:, : H * D * D].view(P, H, D, D)
    ref_pages, dev_pages = pages.clone(), pages.to(DEVICE)
    o_ref = kda_decode_step_(*ins_cpu, pool(ref_pages), slots)
    o = kda_decode_step_(*ins_dev, pool(dev_pages), slots.to(DEVICE))
    errs = {"o": rel_errors(o.cpu(), o_ref), "pool": rel_errors(dev_pages.cpu(), ref_pages)}
    live = slots >= 0
    live_dev, slots_dev = live.to(DEVICE), slots[live].to(DEVICE)
    t_new = do_bench(lambda: kda_decode_step_(*ins_dev, pool(dev_pages), slots.to(DEVICE)))
    t_torch = do_bench(lambda: _pool_step_(*(x[live_dev] for x in ins_dev), pool(dev_pages), slots_dev, None))
    report.checks.append({"kind": "decode step vs CPU", "N": N, "H": H, "errors": errs})
    report.notes.append({"decode_step": f"N={N} H={H} D={D}", "triton_ms": t_new, "torch_ms": t_torch})
    print(f"[decode] N={N} H={H} D={D}: o {errs['o']['max_rel']:.1e} pool {errs['pool']['max_rel']:.1e} (max rel "
          f"vs CPU); Triton in place {t_new * 1e3:.1f} us, PyTorch step {t_torch * 1e3:.1f} us "
          f"({t_torch / t_new:.1f}x)", flush=True)  # fmt: skip


def copy_bandwidth() -> float:
    x = torch.empty(2**30 // 2 if DEVICE == "cuda" else 2**20, device=DEVICE, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=200)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def fwd_flops(shape: Shape) -> float:
    d, T = shape.D, shape.tokens
    return shape.H * (6 * T * d * d + 3 * T * C * d + T * C * C)


def io_bytes(ins) -> int:
    q, k, v, g, beta = ins
    return sum(x.numel() * x.element_size() for x in (q, k, v, g, beta)) + v.numel() * v.element_size()


def time_shape(report: Report, shape: Shape, impls: list[str], bw: float) -> None:
    """First calls (autotune at this shape), the check against FLA's output and grads, then timings."""
    ins, cu = make_inputs(shape)
    N = shape.B if cu is None else len(cu) - 1
    first_s, outs = {}, {}
    for name in impls:
        t0 = time.time()
        h0 = torch.zeros(N, shape.H, shape.D, shape.D, device=DEVICE, requires_grad=True)
        checked = name.startswith("ours") or name == "fla_safe"
        outs[name] = run_fwd_bwd(impl_fn(name), ins, cu, h0) if checked else None
        o, _ = impl_fn(name)(*ins, None, False, cu)
        torch.autograd.grad(o, ins, torch.randn_like(o))
        sync()
        first_s[name] = time.time() - t0
    for name in [n for n in impls if n.startswith("ours") and outs.get("fla_safe")]:
        errs = {key: rel_errors(outs[name][key], outs["fla_safe"][key]) for key in outs[name]}
        report.checks.append({"kind": "vs FLA safe", "impl": name, "shape": shape.label(), "errors": errs})
        print(f"[check] {name} vs fla_safe {shape.label()}: "
              + " ".join(f"{k}={e['rms_rel']:.1e}/{e['max_rel']:.1e}" for k, e in errs.items()), flush=True)  # fmt: skip
    del outs
    for name in impls:
        fwd_ms, fb_ms = _bench(impl_fn(name), ins, cu)
        floor_ms = io_bytes(ins) / bw * 1e3
        row = {
            "shape": shape.label(), "impl": name, "fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms,
            "fwd_tflops": fwd_flops(shape) / (fwd_ms * 1e-3) / 1e12, "roofline_frac_fwd": floor_ms / fwd_ms,
            "floor_ms": floor_ms, "first_call_s": first_s[name],
        }  # fmt: skip
        report.timings.append(row)
        print(f"[time] {shape.label():24s} {name:8s} fwd {fwd_ms:7.3f} ms  fwd+bwd {fb_ms:7.3f} ms  "
              f"{row['fwd_tflops']:6.1f} TFLOP/s  roofline {row['roofline_frac_fwd']:.3f}  (first calls {first_s[name]:.0f} s)", flush=True)  # fmt: skip
    sync()


def _bench(fn, ins, cu) -> tuple[float, float]:
    """Median ms of the forward (no autograd graph) and of forward + backward (grads of every input)."""
    do = torch.randn_like(ins[2])

    def fwd():
        with torch.no_grad():
            fn(*ins, None, False, cu)

    def fwd_bwd():
        o, _ = fn(*ins, None, False, cu)
        torch.autograd.grad(o, ins, do)

    return do_bench(fwd), do_bench(fwd_bwd)


def warm_one(spec: str) -> None:
    """Compile/autotune one (impl, H, varlen) combination at a short length; runs in a subprocess."""
    name, shape_name = spec.split(":")
    ins, cu = make_inputs(SHAPES[shape_name])
    o, _ = impl_fn(name)(*ins, None, False, cu)
    torch.autograd.grad(o, ins, torch.randn_like(o))
    sync()


def start_warm(shapes: list[Shape], impls: list[str], out: Path) -> dict:
    """Subprocesses that compile (and, for FLA, autotune at the real size) every combination.

    FLA's autotune keys include H (and varlen), so one process per (mode, first shape of each H/varlen
    key) autotunes at that shape's real size and leaves the picks in Triton's cache (FLA_CACHE_RESULTS=1),
    for the timing process to reuse. Ours keys on K, V, H but compiles the same binaries for every H, so
    one process per variant compiles; the timing process re-tunes ours itself (a few seconds).
    """
    keyed = {}
    for s in shapes:
        keyed.setdefault((s.H, bool(s.varlen)), s)
    specs = [f"{name}:{s.name}" for name in impls if name.startswith("fla") for s in keyed.values()]
    specs += [f"{name}:{shapes[0].name}" for name in impls if name.startswith("ours")]
    procs = {}
    for spec in specs:
        log = open(out / f"warm_{spec.replace(':', '_')}.log", "w")  # noqa: SIM115 (closed in wait_warm)
        cmd = [sys.executable, __file__, "--warm-one", spec] + (["--smoke"] if DEVICE == "cpu" else [])
        procs[spec] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
    return procs


def wait_warm(procs: dict, t0: float, limit_s: float) -> dict:
    done = {}
    while procs and time.time() - t0 < limit_s:
        for spec, (p, log) in list(procs.items()):
            if p.poll() is not None:
                done[spec] = {"rc": p.returncode, "s": round(time.time() - t0)}
                log.close()
                del procs[spec]
        time.sleep(1)
    for spec, (p, log) in procs.items():
        p.kill()
        log.close()
        done[spec] = {"rc": "killed", "s": round(time.time() - t0)}
    print(f"[warm] {json.dumps(done)}", flush=True)
    return done


def autotune_picks(report: Report) -> None:
    """The config each of our autotuned kernels picked, per autotune key (H, K, V, precision...)."""
    from triton.runtime.autotuner import Autotuner

    from kernels.kda.triton import bwd, fwd

    picks = {}
    for mod in (fwd, bwd):
        for name, obj in vars(mod).items():
            if isinstance(obj, Autotuner) and obj.cache:
                picks[name] = {str(key): str(cfg) for key, cfg in obj.cache.items()}
    report.notes.append({"autotune_picks": picks})
    for name, by_key in picks.items():
        for key, cfg in by_key.items():
            print(f"[picks] {name} {key}: {cfg}", flush=True)


def profile(report: Report, shape: Shape, name: str = "ours", steps: int = 5) -> None:
    """GPU time per kernel of forward + backward (torch.profiler), averaged over `steps`."""
    ins, cu = make_inputs(shape)
    fn = impl_fn(name)
    do = torch.randn_like(ins[2])

    def step():
        o, _ = fn(*ins, None, False, cu)
        torch.autograd.grad(o, ins, do)

    step()
    sync()
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CUDA if DEVICE == "cuda" else act.CPU]) as prof:
        for _ in range(steps):
            step()
        sync()
    rows = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total if DEVICE == "cuda" else ev.self_cpu_time_total
        if us > 0:
            rows.append((ev.key[:60], us / steps / 1e3, ev.count // steps))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    report.notes.append({"profile": shape.label(), "impl": name, "kernels_ms": rows[:20], "total_ms": total})
    print(f"[profile] {name} {shape.label()} fwd+bwd, GPU ms per step (total {total:.3f}):", flush=True)
    for key, ms, count in rows[:16]:
        print(f"    {ms:8.3f} ms  x{count:<3d} {key}", flush=True)


def markdown(report: Report) -> str:
    """One row per (shape, implementation); ratios are FLA safe time / this time (> 1: faster)."""
    rows = {}
    for r in report.timings:
        rows.setdefault(r["shape"], {})[r["impl"]] = r
    lines = [
        "| shape | impl | fwd | fwd+bwd | ratio fwd (vs FLA safe) | ratio fwd+bwd (vs FLA safe) | "
        "fwd TFLOP/s | fwd roofline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, by in rows.items():
        peer = by.get("fla_safe")
        for name, r in by.items():
            ratio = lambda k: f"{peer[k] / r[k]:.2f}x" if peer else "-"  # noqa: B023 (used at once)
            lines.append(
                f"| {shape} | {name} | {r['fwd_ms']:.3f} ms | {r['fwd_bwd_ms']:.3f} ms | {ratio('fwd_ms')} | "
                f"{ratio('fwd_bwd_ms')} | {r['fwd_tflops']:.1f} | {r['roofline_frac_fwd']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--shapes", default="s1,s2,s3,s4,v")
    ap.add_argument("--impls", default="ours,fla_safe,fla_unb")
    ap.add_argument("--check", default="ours,fla_safe", help="impls checked against the float64 reference")
    ap.add_argument("--warm", action="store_true", help="compile all combinations in parallel first")
    ap.add_argument("--profile", default="", help="shapes to profile ours on (per-kernel GPU time)")
    ap.add_argument("--decode", action="store_true", help="check and time the decode step too")
    ap.add_argument("--warm-limit", type=float, default=300.0)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; no new shape starts after this")
    ap.add_argument("--warm-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--smoke", action="store_true", help="CPU + TRITON_INTERPRET at toy sizes (plumbing only)"
    )
    args = ap.parse_args()
    if args.smoke:
        global DEVICE, DTYPE
        DEVICE, DTYPE = "cpu", torch.float32
        for name, s in SHAPES.items():
            SHAPES[name] = Shape(name, s.B, 128, 2, 16, varlen=2 if s.varlen else 0)
    if args.warm_one:
        return warm_one(args.warm_one)
    t_start = time.time()
    impls = [s for s in args.impls.split(",") if s]
    shapes = [SHAPES[s] for s in args.shapes.split(",") if s]
    report = Report()
    import triton

    report.env = {
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (interpreter smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    try:
        import fla

        report.env["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        impls = [i for i in impls if i.startswith("ours")]
        report.notes.append("flash-linear-attention not importable: peer not measured")
    print(f"[env] {report.env}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    procs = start_warm(shapes, impls, args.out) if args.warm else {}
    ours = [n for n in impls if n.startswith("ours")]
    # Not while warming: 11 processes autotuning on one GPU made this float64 loop take minutes.
    if ours and not args.warm:  # ours against float64 at a head count not timed below
        for T, varlen in ((512, False), (300, True)):
            check_against_reference(
                report, ours, 8 if DEVICE == "cuda" else 2, T if DEVICE == "cuda" else 80, varlen
            )
        report.save(args.out)
    if procs:
        report.env["warm"] = wait_warm(procs, t_start, args.warm_limit)
    if args.decode:
        check_decode(report)
    bw = copy_bandwidth()
    report.env["copy_bandwidth_TBps"] = bw / 1e12
    print(f"[env] copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for shape in shapes:
        if time.time() - t_start > args.budget:
            report.notes.append(f"budget reached before {shape.label()}")
            break
        time_shape(report, shape, impls, bw)
        report.save(args.out)
    if any(i.startswith("ours") for i in impls) and DEVICE == "cuda":
        autotune_picks(report)
    for spec in [s for s in args.profile.split(",") if s]:  # shape[:impl]
        shape_name, _, impl = spec.partition(":")
        profile(report, SHAPES[shape_name], impl or "ours")
        report.save(args.out)
    # After the timings, so that every autotuner has picked its configs at the real shapes.
    checks = [i for i in args.check.split(",") if i in impls]
    ref_cases = (
        ((16, 512, False), (96, 256, False), (32, 512, True)) if DEVICE == "cuda" else ((2, 80, True),)
    )
    for H, T, varlen in ref_cases:
        if checks and time.time() - t_start < args.budget + 60:
            check_against_reference(report, checks, H, T, varlen)
            report.save(args.out)
    table = markdown(report)
    (args.out / "kda_bench.md").write_text(table + "\n")
    print(table, flush=True)
    print(f"[done] {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
