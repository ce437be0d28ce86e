"""Learner scaling: tokens/s, MFU, peak memory per GPU and scaling efficiency of the sharded learner over ranks.

    python bench/learner_scaling.py --out DIR [--presets gpu_1b,gpu_8b] [--world-sizes 1,2,4,8]
                                    [--tokens 16384] [--expert-parallel 1] [--checkpoint none]
                                    [--steps 3] [--warmup 1] [--budget 540]
    python bench/learner_scaling.py --out DIR --small    # CPU, gloo, world sizes 1 and 2, tiny model

For every preset and world size N (default 1, 2, 4, 8, capped at the visible GPU count) it starts the learner
group the RL loop starts (``rl.learner_group.LearnerGroup``: N Ray actors, one GPU each, one process group,
FSDP2 and, with ``--expert-parallel`` ep, experts split over a dp x ep mesh by ``rl/parallel.py``;
``learner.sharding=fsdp`` also at N = 1) and trains it on packed varlen micro-batches built as
bench/learner_mfu.py builds them (episode lengths log-uniform in 128..6144 tokens, prompts without loss,
replayed routes). Weak scaling: a step is one mini-batch of N micro-batches of ``--tokens`` tokens, so every
rank trains on ``--tokens`` tokens per step whatever N is; the loss weights are normalised over the whole
mini-batch (as rl/batching.py does), so the step's gradient is the mini-batch's however it is split.

Check before timing: the first step's loss and gradient norm at world size N (through ``LearnerGroup.
train_step``, the RL loop's fan-out) equal those of the smallest world size of the run that fits (the base:
world size 1 when it fits) on the same global batch, from the same initial weights, within
bench/learner_fsdp_smoke.py's tolerances (bf16: rel 2e-2, fp32: rel 1e-4). The base computes the reference of
every N: its first step on each N's global batch, its weights and optimizer restored in between. A row whose
check fails is not timed (exit 1).

Timing: ``--warmup`` steps, then ``--steps`` steps timed inside the ranks (each rank gets its share of the
mini-batch as ``LearnerGroup.train_step`` spreads it, ``rl.learner_group.spread_minibatches``; a barrier
before every step, the device synchronised after it): a step's time is the slowest rank's, and the row reports
the median step. The Ray transfer of the batch to the ranks is not in it (the learner's throughput, not the
driver's). Per row: tokens/s (global: N x tokens / step), MFU as bench/learner_mfu.py defines it (6 x active
matmul parameters x tokens / step time / bf16 GEMM peak, the peak measured once in this run on one GPU; over N
GPUs divided by N x peak), peak memory allocated per GPU (the max over ranks, over the timed steps), and
scaling efficiency = tokens/s(N) / (N / base x tokens/s(base)), i.e. tokens/s(N) / (N x tokens/s(1)) when the
base is world size 1.

A preset that cannot fit is reported, not crashed on: a world size whose model states alone (fp32 weights,
gradients and two AdamW moments, 16 bytes per parameter, sharded over N) exceed 90% of a GPU's memory is
skipped unbuilt, and an out-of-memory error in a rank marks the row "does not fit" (gpu_8b at N = 1: 117 GiB
of states pass the estimate on a 140 GiB H200, its activations do not fit beside them; ``--world-sizes
2,4,8`` saves building it, ``--checkpoint layer`` recomputes activations). ``--budget`` seconds: no new row
starts after it (one device call is limited to 10 minutes). Results: ``DIR/learner_scaling.json`` and
``DIR/learner_scaling.md``, rewritten after every row; exit 1 when a check failed or a row raised.

Device run (one H200; the lead's environment puts Ray, omegaconf and fla-core on PYTHONPATH)::

    python3 bench/learner_scaling.py --out $OUT --presets gpu_1b --tokens 16384
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import learner_mfu  # noqa: E402
from bench.learner_fsdp_smoke import STEP1_REL_TOL, learner_config, step1_matches  # noqa: E402
from bench.learner_mfu import SMALL_ARCH, Clock, episode_lengths, gemm_peak, load_arch, make_batch  # noqa: E402

STATE_BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW's two moments, all sharded by FSDP2
FIT_FRACTION = 0.9  # of a GPU's memory the model states may take before a row is skipped unbuilt


@dataclass
class Report:
    env: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "learner_scaling.json").write_text(json.dumps(asdict(self), indent=1, default=str))
        (out / "learner_scaling.md").write_text(markdown(self) + "\n")


# ------------------------------------------------------------------------------------------ inputs
def preset_arch(name: str) -> dict:
    return dict(SMALL_ARCH) if name == "small" else load_arch(ROOT / "configs" / "model" / f"{name}.yaml")


def model_sizes(arch: dict) -> tuple[int, int]:
    """(parameters, active matmul parameters: bench/learner_mfu.py's ``matmul_params``) of ``arch``, counted on
    the meta device (no memory, no init)."""
    from model import HybridConfig
    from model.modeling import HybridForCausalLM

    config = HybridConfig(**arch)
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    return total, learner_mfu.matmul_params(model, config.num_experts_per_token, config.num_experts)


def global_batch(config, tokens: int, n: int, seed: int) -> list:
    """One mini-batch of ``n`` packed micro-batches of ``tokens`` tokens each (``make_batch``), its loss weights
    normalised over all of them: the sum of the ranks' gradients is the mini-batch's gradient."""
    micro = [make_batch(episode_lengths(tokens, np.random.default_rng([seed, i])), config, seed=seed * 1000 + i)
             for i in range(n)]  # fmt: skip
    total = sum(int(mb.loss_mask_T.sum()) for mb in micro)
    return [replace(mb, token_weights_T=mb.loss_mask_T.float() / max(total, 1)) for mb in micro]


# ------------------------------------------------------------------------------------------ rank side
# Run inside the learner ranks by ``ActorHandle.__ray_call__`` (the function gets the rank's Learner first); they
# use nothing of ``bench`` (the ranks cannot import it), hence bench/learner_mfu.py's snapshot / restore inline.
def _rank_snapshot(learner) -> None:
    learner.scaling_init = {k: v.detach().clone() for k, v in learner.base_model.state_dict().items()}


def _rank_restore(learner) -> None:
    """Back to the snapshot: weights (DTensor shards), balancer biases (buffers), no AdamW state, counters 0."""
    learner.base_model.load_state_dict(learner.scaling_init)
    learner.optimizer.state.clear()
    learner.step_count = learner.version = 0


def _rank_drop_snapshot(learner) -> None:
    del learner.scaling_init
    gc.collect()
    if learner.device.type == "cuda":
        torch.cuda.empty_cache()


def _rank_timed_steps(learner, share: list, steps: int) -> dict:
    """``steps`` train steps on this rank's share, each after a barrier and timed to the device's end; the
    peak memory allocated over them."""
    cuda = learner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        learner.train_step(share)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return {"seconds": seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def on_ranks(group, fn, *per_rank) -> list:
    """``fn(learner, *args)`` on every rank at once (``per_rank``: one argument list per rank, or none)."""
    import ray

    args = list(zip(*per_rank)) if per_rank else [()] * len(group.ranks)
    return ray.get([a.__ray_call__.remote(fn, *xs) for a, xs in zip(group.ranks, args)])


def ranks_pickle_by_value() -> None:
    """The rank-side functions travel to the ranks by value (as everything of ``__main__`` does): a rank cannot
    import this file under the name a test imported it by, nor ``bench`` (not a package of the install)."""
    import ray.cloudpickle

    if __name__ != "__main__":
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------------------------ one row
@dataclass
class Plan:
    """What every row of one preset shares."""

    preset: str
    arch: dict
    params: int
    matmul_params: int
    dtype: str
    peak_flops: float
    gpu_gib: float | None  # one GPU's memory; None on the CPU
    refs: dict = field(default_factory=dict)  # world size -> the base's first step on that size's batch
    ref_world: int | None = None  # the world size that computed ``refs`` (the smallest that ran them)
    base: dict | None = None  # the row scaling efficiency is taken against (the smallest one timed)


def skip_reason(plan: Plan, n: int, ep: int, args) -> str | None:
    if args.cuda and n > args.gpus:
        return f"skipped: needs {n} GPUs, {args.gpus} visible"
    if n % ep or plan.arch["num_experts"] % ep:
        return f"skipped: expert_parallel={ep} must divide the world size ({n}) and num_experts"
    states = STATE_BYTES_PER_PARAM * plan.params / n / 2**30
    if plan.gpu_gib is not None and states > FIT_FRACTION * plan.gpu_gib:
        return (f"does not fit: model states alone {states:.0f} GiB per GPU (16 B x {plan.params / 1e9:.2f}B "
                f"parameters / {n}) against {plan.gpu_gib:.0f} GiB")  # fmt: skip
    return None


def start_group(plan: Plan, n: int, ep: int, args):
    from model import HybridConfig
    from rl.learner_group import LearnerGroup

    cfg = learner_config(plan.arch, args.tokens, plan.dtype)
    lc = replace(cfg.learner, num_workers=n, expert_parallel=ep, torch_threads=1 if args.small else None,
                 device="cuda" if args.cuda else "cpu", activation_checkpointing=args.checkpoint != "none",
                 checkpoint_scope=args.checkpoint if args.checkpoint != "none" else "layer")  # fmt: skip
    return LearnerGroup(cfg.model, lc, cfg.algorithm), HybridConfig(**plan.arch)


def stop_group(group) -> None:
    """Kill the ranks and wait until Ray reports them dead, so the next row's ranks find their GPUs free."""
    import ray

    def dead(actor) -> bool:
        try:
            ray.get(actor.rank.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        return False

    group.shutdown()
    deadline = time.time() + 120
    for a in group.ranks:
        while not dead(a) and time.time() < deadline:
            time.sleep(0.5)
    if torch.cuda.is_available():
        time.sleep(3)  # the killed processes' CUDA contexts


def first_step(group, batch) -> dict:
    t0 = time.time()
    m = group.train_step([batch])
    return {"loss": m["loss"], "grad_norm": m["grad_norm"], "seconds": time.time() - t0}


def reference_steps(plan: Plan, group, config, n: int, args) -> dict:
    """The base's first step on every world size's global batch, each from the initial weights; returns its own."""
    on_ranks(group, _rank_snapshot)
    refs = {}
    for k in [n, *(s for s in args.world_sizes if s > n and (s <= args.gpus or not args.cuda))]:
        if k != n:
            on_ranks(group, _rank_restore)
        refs[k] = first_step(group, global_batch(config, args.tokens, k, seed=k))
    on_ranks(group, _rank_drop_snapshot)
    plan.refs, plan.ref_world = refs, n
    return refs[n]


def check_row(plan: Plan, row: dict, got: dict) -> bool:
    want = plan.refs.get(row["world_size"])
    if want is None:
        row["check"] = {"ok": False, "why": "no reference: the base ran no step on this world size's batch"}
        return False
    rel = STEP1_REL_TOL[plan.dtype]
    loss_ok, norm_ok = step1_matches(got, want, rel)
    row["check"] = {"ok": loss_ok and norm_ok, "base_world_size": plan.ref_world, "rel_tol": rel,
                    "loss": got["loss"], "base_loss": want["loss"], "grad_norm": got["grad_norm"],
                    "base_grad_norm": want["grad_norm"]}  # fmt: skip
    return loss_ok and norm_ok


def run_row(plan: Plan, row: dict, args) -> None:
    """Build the group, check its first step against the base's, time it; ``row`` filled in place."""
    from rl.learner_group import spread_minibatches

    n, t0 = row["world_size"], time.time()
    group, config = start_group(plan, n, row["expert_parallel"], args)
    try:
        row["build_s"] = time.time() - t0
        batch = global_batch(config, args.tokens, n, seed=n)
        if plan.ref_world is None:  # the base: every world size's reference step, its own first
            got = reference_steps(plan, group, config, n, args)
        else:
            got = first_step(group, batch)
        row["first_step_s"] = got["seconds"]
        if not check_row(plan, row, got):
            row["status"] = "check failed: not timed"
            return
        for _ in range(args.warmup):
            group.train_step([batch])
        shares = spread_minibatches([batch], n)
        ranks = on_ranks(group, _rank_timed_steps, shares, [args.steps] * n)
        per_step = [max(r["seconds"][i] for r in ranks) for i in range(args.steps)]
        step_s = statistics.median(per_step)
        peaks = [r["peak_gib"] for r in ranks]
        row.update(status="ok", step_s=step_s, step_s_all=per_step, tokens_per_s=row["tokens_per_step"] / step_s,
                   mfu=6 * plan.matmul_params * row["tokens_per_step"] / step_s / (n * plan.peak_flops),
                   peak_gib=max(peaks) if None not in peaks else None, peak_gib_per_rank=peaks)  # fmt: skip
        if plan.base is None:
            plan.base = row
        base = plan.base
        row["efficiency_base"] = base["world_size"]
        row["scaling_efficiency"] = row["tokens_per_s"] / (n / base["world_size"] * base["tokens_per_s"])
    finally:
        stop_group(group)


def failed_status(e: BaseException) -> str:
    text = str(e)
    if "out of memory" in text.lower() or "OutOfMemoryError" in text:
        return "does not fit: out of memory in a rank"
    return f"error: {type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def run_preset(report: Report, preset: str, args, peak: float, t_start: float) -> None:
    arch = preset_arch(preset)
    params, n_mm = model_sizes(arch)
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if args.cuda else None
    plan = Plan(preset, arch, params, n_mm, "bfloat16" if args.cuda else "float32", peak, gpu_gib)
    for n in args.world_sizes:
        ep = args.expert_parallel if n > 1 else 1  # world size 1: the one-GPU baseline, all experts local
        row = {"preset": preset, "world_size": n, "expert_parallel": ep, "tokens_per_rank": args.tokens,
               "tokens_per_step": n * args.tokens, "checkpoint": args.checkpoint, "params": params,
               "active_matmul_params": n_mm}  # fmt: skip
        if time.time() - t_start > args.budget:
            row["status"] = "not run: --budget reached"
        elif (why := skip_reason(plan, n, ep, args)) is not None:
            row["status"] = why
        else:
            print(f"[row] {preset} world size {n} (ep {ep})", flush=True)
            try:
                run_row(plan, row, args)
            except Exception as e:  # a row that raises is reported, the run goes on
                row["status"] = failed_status(e)
                row["traceback"] = traceback.format_exc()[-4000:]
                print(row["traceback"], flush=True)
        print(
            f"[row] {json.dumps({k: v for k, v in row.items() if k != 'traceback'}, default=str)}", flush=True
        )
        report.rows.append(row)
        report.save(args.out)


# ------------------------------------------------------------------------------------------ output
def markdown(report: Report) -> str:
    lines = ["| preset | GPUs | EP | tokens / step | step | tokens/s | MFU | peak memory / GPU | scaling efficiency "
             "| step 1 vs base (loss, grad norm) | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report.rows:
        c = r.get("check") or {}
        check = "-"
        if "base_loss" in c:
            check = "base" if c["base_world_size"] == r["world_size"] else (
                f"{c['loss']:.5g} vs {c['base_loss']:.5g}, {c['grad_norm']:.5g} vs {c['base_grad_norm']:.5g} "
                f"(N={c['base_world_size']}): {'ok' if c['ok'] else 'FAILED'}")  # fmt: skip
        if r.get("status") != "ok":
            lines.append(f"| {r['preset']} | {r['world_size']} | {r['expert_parallel']} | {r['tokens_per_step']} | "
                         f"- | - | - | - | - | {check} | {r['status']} |")  # fmt: skip
            continue
        mem = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "-"
        eff = f"{r['scaling_efficiency'] * 100:.0f}% (vs N={r['efficiency_base']})"
        lines.append(f"| {r['preset']} | {r['world_size']} | {r['expert_parallel']} | {r['tokens_per_step']} | "
                     f"{r['step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:.0f} | {r['mfu'] * 100:.2f}% | {mem} | {eff} | "
                     f"{check} | ok |")  # fmt: skip
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--small", action="store_true", help="CPU, gloo, fp32, a tiny model: the plumbing only")
    p.add_argument(
        "--presets", default=None, help="configs/model presets (default gpu_1b,gpu_8b; --small: small)"
    )
    p.add_argument(
        "--world-sizes", default=None, help="default 1,2,4,8 capped at the visible GPUs (--small: 1,2)"
    )
    p.add_argument(
        "--tokens", type=int, default=None, help="tokens per rank per step (default 16384; --small 512)"
    )
    p.add_argument(
        "--expert-parallel", type=int, default=1, help="learner.expert_parallel of world sizes > 1"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 3; --small 2)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps after the first (default 1; --small 0)"
    )
    p.add_argument("--checkpoint", default="none", choices=["none", "layer", "ffn", "attention"],
                   help="activation checkpointing scope (learner.checkpoint_scope); none: off")  # fmt: skip
    p.add_argument("--budget", type=float, default=540.0, help="seconds: no new row starts after this")
    args = p.parse_args(argv)
    args.cuda = torch.cuda.is_available() and not args.small
    args.gpus = torch.cuda.device_count() if args.cuda else 0
    small = {"presets": "small", "world_sizes": "1,2", "tokens": 512, "steps": 2, "warmup": 0}
    full = {"presets": "gpu_1b,gpu_8b", "world_sizes": None, "tokens": 16384, "steps": 3, "warmup": 1}
    for k, v in (small if args.small else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.world_sizes is None:
        args.world_sizes = ",".join(str(n) for n in (1, 2, 4, 8) if n <= max(args.gpus, 1))
    args.presets = args.presets.split(",")
    args.world_sizes = sorted({int(n) for n in args.world_sizes.split(",")})
    if min(args.world_sizes) < 1 or args.steps < 1 or args.tokens < 2:
        p.error("world sizes and --steps must be >= 1, --tokens >= 2")
    for name in args.presets:
        if name != "small" and not (ROOT / "configs" / "model" / f"{name}.yaml").is_file():
            p.error(f"--presets: no configs/model/{name}.yaml")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not args.cuda and not args.small:
        print("no CUDA device: run with --small (the CPU plumbing) or on a GPU machine", file=sys.stderr)
        return 2
    import ray

    from rl.config import RayConfig
    from rl.launch import connect_ray

    t_start = time.time()
    report = Report(env={"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                         "device": torch.cuda.get_device_name(0) if args.cuda else platform.processor() or "cpu",
                         "gpus": args.gpus, "torch": torch.__version__, "small": args.small,
                         "backend": "nccl" if args.cuda else "gloo"})  # fmt: skip
    peak = gemm_peak(Clock(args.cuda), args.cuda)  # in this process, before any rank holds a GPU
    report.env["gemm_peak_tflops"] = peak / 1e12
    torch.cuda.empty_cache() if args.cuda else None
    if not ray.is_initialized():
        connect_ray(RayConfig(num_cpus=max(os.cpu_count() or 1, max(args.world_sizes) + 1)))
    ranks_pickle_by_value()
    for preset in args.presets:
        run_preset(report, preset, args, peak, t_start)
    print(markdown(report), flush=True)
    print(f"[done] {time.time() - t_start:.0f} s", flush=True)
    bad = [r for r in report.rows if r["status"].startswith(("check failed", "error"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
