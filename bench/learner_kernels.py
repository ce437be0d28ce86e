"""The learner's memory-bound kernels alone, at the shapes one gpu_1b step gives them: which launch is fastest.

Three parts of ``bench/learner_mfu.py``'s step are bound by memory, not by the tensor cores (the H200's profiled
step, bench/RESULTS.md): the AttnRes mix + norm node (``kernels.attnres.triton``, one call a sub-layer: 32 a step;
its backward several times its forward), the KDA short convolution (``kernels.conv``, q, k and v of every KDA
layer: 36 a step; likewise) and the optimizer step (fused AdamW over every fp32 parameter: 28 bytes a parameter,
~16 ms of an H100 step). Per kernel and launch variant (tile, warps, programs; the backward kernels of the A/B;
AdamW over the parameter tensors as the learner holds them, or over one flat buffer) this script

1. checks the outputs and every gradient against the PyTorch reference (``model.attnres.attn_res_mix_norm`` /
   ``attn_res_mix_norm_grads``, ``kernels.conv.causal_conv1d_naive`` and its autograd) on the step's shapes;
2. times it in replayed CUDA graphs (``grouped_mm_decode.graph_us``), and gives the bytes it must move (each
   input read once, each output written once) over that time, against a device-to-device copy measured in the
   same run (the bandwidth a memory-bound kernel can reach).

The shapes are captured from one forward of the preset's model on the packed micro-batch of ``learner_mfu``
(bf16 autocast on CUDA): the AttnRes nodes' source counts and dtypes, the convolutions' [rows, channels] and
dtype, each with its calls per step. Per kernel the table gives the step's time on the default launch and on
the fastest variant that passed the check. Other variants are a one-line change of the defaults
(``kernels.conv.triton.FWD_LAUNCH`` / ``BWD_LAUNCH``, ``kernels.attnres.triton.PROGRAMS_PER_SM`` and the
kernels' warps); a variant is a default only after ``learner_mfu.py`` times the whole step with it.

    python3 bench/learner_kernels.py --out DIR [--tokens 16384] [--quick]   # DIR/learner_kernels.{json,md}

On a CPU (``--small``: the tiny preset, ``TRITON_INTERPRET=1``) the checks run and the times are the
interpreter's: plumbing, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative Frobenius error, per dtype


# ------------------------------------------------------------------------------------------ shapes
def lengths_of(tokens: int) -> list[int]:
    """``learner_mfu``'s episode lengths of a micro-batch (shorter ones for the CPU's small batch)."""
    from learner_mfu import episode_lengths

    return episode_lengths(tokens, np.random.default_rng(tokens), lo=max(1, min(128, tokens // 4)))


def capture_shapes(arch: dict, tokens: int, device: torch.device) -> dict:
    """{"attn_res": {(S, dtypes): calls}, "conv": {(R, C, K, dtype, silu): calls}, "adamw": {parameter shapes: 1}}
    of one forward of the model on ``learner_mfu``'s packed micro-batch of ``tokens`` tokens (bf16 autocast on
    CUDA, as the learner), and the model's parameters (one optimizer step a micro-batch in the bench's step)."""
    from model import HybridConfig, HybridForCausalLM
    from model.attnres import AttnResMix
    from model.layers import ShortConvolution

    config = HybridConfig(**arch)
    model = HybridForCausalLM(config).to(device)
    seen = {"attn_res": collections.Counter(), "conv": collections.Counter()}

    def on_mix(module, args, kwargs):
        sources, norm = [*args, kwargs.get("norm")][:2]
        if norm is not None and len(sources) > 1:  # the mix + norm node (a single source is only normed)
            seen["attn_res"][(len(sources), tuple(str(t.dtype) for t in sources))] += 1

    def on_conv(module, x):
        silu = module.activation == "silu"
        seen["conv"][(x.shape[0] * x.shape[1], x.shape[2], module.kernel_size, str(x.dtype), silu)] += 1

    # the module call (the reference layout's path) and ``conv_positions`` (the planned path a CUDA learner takes,
    # ``model.kda.kda_planned_forward``): each conv of the forward goes through exactly one of them
    hooks = [m.register_forward_pre_hook(on_mix, with_kwargs=True) for m in model.modules() if isinstance(m, AttnResMix)]
    hooks += [m.register_forward_pre_hook(lambda conv, args: on_conv(conv, args[0]))
              for m in model.modules() if isinstance(m, ShortConvolution)]  # fmt: skip
    real_positions = ShortConvolution.conv_positions

    def conv_positions(self, x_BTC, pos_BT):
        on_conv(self, x_BTC)
        return real_positions(self, x_BTC, pos_BT)

    lengths = lengths_of(tokens)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=device, dtype=torch.int32)
    seen["adamw"] = collections.Counter({tuple(tuple(p.shape) for p in model.parameters()): 1})
    ShortConvolution.conv_positions = conv_positions
    try:
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            model.model(input_ids=ids, cu_seqlens=cu)  # the decoder only: no logits
    finally:
        ShortConvolution.conv_positions = real_positions
        for h in hooks:
            h.remove()
    del model
    return seen


# ------------------------------------------------------------------------------------------ timing
def timer(device: torch.device):
    """Microseconds a call: replayed CUDA graphs of 5 calls on CUDA; elsewhere the wall time of one call (the
    CPU run is plumbing under the Triton interpreter, not a measurement: one call keeps it short)."""
    if device.type == "cuda":
        from grouped_mm_decode import graph_us

        return lambda fn: graph_us(fn, calls=5, reps=20)

    def wall_us(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    return wall_us


def copy_gbs(device: torch.device, time_us) -> float:
    """Bytes read + written per second of a 256 MiB device-to-device copy."""
    n = (256 << 20) // 2 if device.type == "cuda" else 1 << 20
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / time_us(lambda: y.copy_(x)) / 1e3


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def dtype_of(name: str) -> torch.dtype:
    """"torch.bfloat16" (as the captured shapes spell a dtype) -> torch.bfloat16."""
    return getattr(torch, name.removeprefix("torch."))


def checked_row(variant: dict, fn, ref: list[torch.Tensor], tol: float, moved: int, time_us) -> dict:
    """``variant``'s row: ``fn()``'s outputs against ``ref`` (the largest relative error of any of them), and only
    if that is within ``tol`` its microseconds a call; ``moved``: the bytes a call must move."""
    from kernels.testing import error_ratio

    out = fn()
    out = [out] if isinstance(out, torch.Tensor) else list(out)
    err = max(error_ratio(r, o) for r, o in zip(ref, out, strict=True))
    row = {**variant, "error": err, "tolerance": tol, "ok": err <= tol, "bytes": moved}
    if row["ok"]:
        row["us"] = time_us(fn)
    return row


# ------------------------------------------------------------------------------------------ AttnRes
def attn_res_case(S: int, dtypes: tuple[str, ...], N: int, D: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    sources = [torch.randn(N, D, generator=g).to(device, dtype_of(dt)) for dt in dtypes]
    weights = [(1 + 0.1 * torch.randn(D, generator=g)).to(device) for _ in range(3)]  # query, key norm, out norm
    dh = torch.randn(N, D, generator=g).to(device, sources[0].dtype)
    return sources, weights, dh


def attn_res_variants(quick: bool) -> list[dict]:
    from kernels.attnres.triton import BACKWARD_KERNELS

    fwd = [{"pass": "forward", "warps": w} for w in ((4,) if quick else (2, 4, 8))]
    programs = (4, 8) if quick else (2, 4, 8, 16)
    bwd = [{"pass": "backward", "kernel": k, "programs_per_sm": p, "warps": w}
           for k, (_, default_warps, _) in BACKWARD_KERNELS.items() for p in programs
           for w in ((default_warps,) if quick else (4, 8))]  # fmt: skip
    return fwd + bwd


def run_attn_res(case, variant: dict, device: torch.device, time_us, eps: float = 1e-5) -> dict:
    from kernels.attnres.triton import mix_norm_forward, mix_norm_grads
    from model.attnres import attn_res_mix_norm, attn_res_mix_norm_grads

    sources, (q, kw, ow), dh = case
    if variant["pass"] == "forward":
        fn = lambda: mix_norm_forward(q, kw, eps, ow, eps, *sources, warps=variant["warps"])
        ref = [attn_res_mix_norm(q, kw, eps, ow, eps, *(s.float() for s in sources))]
        moved = nbytes(*sources) + nbytes(sources[0])  # the output in the sources' (promoted) dtype
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        fn = lambda: mix_norm_grads(q, kw, eps, ow, eps, dh, *sources, kernel=variant["kernel"],
                                    programs=variant["programs_per_sm"] * sms, warps=variant["warps"])
        ref = attn_res_mix_norm_grads(q, kw, eps, ow, eps, dh.float(), *(s.float() for s in sources))
        moved = 2 * nbytes(*sources) + nbytes(dh)
    return checked_row(variant, fn, list(ref), max(TOL[s.dtype] for s in sources), moved, time_us)


# ------------------------------------------------------------------------------------------ conv
def conv_case(R: int, C: int, K: int, dtype: str, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = dtype_of(dtype)
    x = torch.randn(R, C, generator=g).to(device, dt)
    w = (torch.randn(C, K, generator=g) / K).to(device, dt)
    pos = torch.cat([torch.arange(n) for n in lengths_of(R)]).to(device, torch.int32)
    dy = torch.randn(R, C, generator=g).to(device, dt)
    return x, w, pos, dy


def conv_variants(quick: bool) -> list[dict]:
    from kernels.conv.triton import BACKWARD_KERNELS

    tiles = ((64, 64, 4),) if quick else ((64, 64, 4), (32, 128, 4), (64, 128, 4), (128, 64, 8), (16, 256, 4), (128, 128, 8))
    fwd = [{"pass": "forward", "block_r": r, "block_c": c, "warps": w} for r, c, w in tiles]
    bwd = [{"pass": "backward", "kernel": k, "block_r": r, "block_c": c, "warps": w}
           for k, (r, c, w) in itertools.product(BACKWARD_KERNELS, tiles)]  # fmt: skip
    return fwd + bwd


def run_conv(case, variant: dict, silu: bool, time_us) -> dict:
    from kernels.conv import causal_conv1d_naive
    from kernels.conv.triton import Launch, conv_rows_bwd, conv_rows_fwd

    x, w, pos, dy = case
    launch = Launch(variant["block_r"], variant["block_c"], variant["warps"])
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    y_ref = causal_conv1d_naive(xr[None], wr, pos[None].long(), "silu" if silu else None)[0]
    if variant["pass"] == "forward":
        fn = lambda: conv_rows_fwd(x, w, pos, silu, launch)
        ref, moved = [y_ref], 2 * nbytes(x)
    else:
        fn = lambda: conv_rows_bwd(x, w, pos, dy, silu, variant["kernel"], launch)
        ref, moved = list(torch.autograd.grad(y_ref, (xr, wr), dy.float())), 3 * nbytes(x)
    return checked_row(variant, fn, ref, TOL[x.dtype], moved, time_us)


# ------------------------------------------------------------------------------------------ AdamW
def adamw_variants(quick: bool) -> list[dict]:
    """The learner's step (``rl.learner``: fused AdamW over every fp32 parameter, the clip's scale read inside it
    as ``grad_scale``) as it runs, one tensor a parameter, and over one flat buffer of them all (what flat
    parameters, as FSDP and Megatron keep them, would give it: one launch instead of a tensor list's chunks)."""
    return [{"pass": "step", "kernel": k} for k in ("per_tensor", "flat")]


ADAMW_TOLERANCE = 4 * torch.finfo(torch.float32).eps
"""The flat step against the per-tensor one (``kernels.testing.error_ratio``): the same element-wise math, but not
the same bits: on an H100 the two differed in last bits (3.0e-8, 2026-12-06; why was not looked into, the fused
kernel may take other code paths for other alignments), so a few fp32 ulps relative to the norm, not zero."""


def run_adamw(shapes: tuple[tuple[int, ...], ...], variant: dict, device: torch.device, time_us) -> dict:
    """One fused AdamW step (capturable, so a CUDA graph replays it) on fp32 parameters of ``shapes``; checked
    against the per-tensor step (the same element-wise math; the per-tensor step is that reference) to
    ``ADAMW_TOLERANCE``, timed; bytes: the parameter, gradient and two moments read, the three written (28 a
    parameter)."""
    from kernels.testing import error_ratio

    sizes = [math.prod(sh) for sh in shapes]
    n = sum(sizes)
    g = torch.Generator(device="cpu").manual_seed(0)
    flat = {k: torch.randn(n, generator=g).to(device) for k in ("p", "g")}

    def build(kernel: str):
        if kernel == "flat":
            params = [torch.nn.Parameter(flat["p"].clone())]
            grads = [flat["g"]]
        else:
            params = [torch.nn.Parameter(t.view(sh).clone()) for t, sh in zip(flat["p"].split(sizes), shapes)]
            grads = [t.view(sh) for t, sh in zip(flat["g"].split(sizes), shapes)]
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        cuda = device.type == "cuda"
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), fused=cuda, capturable=cuda)
        if cuda:  # the clip's scale, as ``Learner._clip_in_step`` sets it (fused steps only)
            opt.grad_scale = torch.tensor(1.5, device=device)
        return params, opt

    def stepped(kernel: str):
        params, opt = build(kernel)
        opt.step()
        return torch.cat([p.detach().reshape(-1) for p in params]), len(params), opt

    got, tensors, opt = stepped(variant["kernel"])
    err = 0.0  # the per-tensor step is the reference itself; another is held to it
    if variant["kernel"] != "per_tensor":
        want, _, ref_opt = stepped("per_tensor")
        err = error_ratio(want, got)
        del want, ref_opt
    del got
    row = {**variant, "error": err, "tolerance": ADAMW_TOLERANCE, "ok": err <= ADAMW_TOLERANCE, "bytes": 28 * n,
           "params": n, "tensors": tensors}  # fmt: skip
    if row["ok"]:
        row["us"] = time_us(opt.step)
    return row


# ------------------------------------------------------------------------------------------ report
def defaults() -> dict[str, dict]:
    """The launch each kernel and pass takes in the learner today, per "op pass"."""
    import inspect

    from kernels.attnres import triton as attnres
    from kernels.conv import triton as conv

    def tile(launch) -> dict:
        return {"block_r": launch.block_r, "block_c": launch.block_c, "warps": launch.warps}

    return {
        "attn_res forward": {"warps": inspect.signature(attnres.mix_norm_forward).parameters["warps"].default},
        "attn_res backward": {"kernel": "tile", "programs_per_sm": attnres.PROGRAMS_PER_SM,
                              "warps": attnres.BACKWARD_KERNELS["tile"][1]},
        "conv forward": tile(conv.FWD_LAUNCH),
        "conv backward": {"kernel": conv.BACKWARD_KERNELS[0], **tile(conv.BWD_LAUNCH)},
        "adamw step": {"kernel": "per_tensor"},
    }  # fmt: skip


def launch_key(row: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in row.items() if k in ("kernel", "programs_per_sm", "warps", "block_r", "block_c")))


def step_table(rows: list[dict], gbs: float) -> tuple[list[str], dict]:
    """Per kernel and pass: the step's microseconds (calls x time, summed over the shapes) for each launch
    that passed on every shape; the default's and the fastest's."""
    lines, summary, default_of = [], {}, defaults()
    for name in default_of:
        op, pas = name.split()
        mine = [r for r in rows if r["op"] == op and r["pass"] == pas]
        if not mine:  # not among --ops
            continue
        by = collections.defaultdict(list)
        for r in mine:
            by[launch_key(r)].append(r)
        n_shapes = len({r["shape"] for r in mine})
        totals = {}
        for key, rs in by.items():
            if len(rs) == n_shapes and all(r["ok"] for r in rs):
                totals[key] = (sum(r["calls"] * r["us"] for r in rs), sum(r["calls"] * r["bytes"] for r in rs))
        if not totals:
            lines.append(f"| {name} | no launch passed on every shape | | | | |")
            continue
        default = launch_key(default_of[name])
        best = min(totals, key=lambda k: totals[k][0])
        d_us = totals.get(default, (float("nan"), 0))[0]
        b_us, b_bytes = totals[best]
        summary[name] = {"default": dict(default), "default_us": d_us, "best": dict(best), "best_us": b_us,
                         "best_of_copy": b_bytes / b_us / 1e3 / gbs}  # fmt: skip
        lines.append(f"| {name} | {d_us:.0f} us | {dict(best)} | {b_us:.0f} us | {d_us / b_us:.2f}x | "
                     f"{b_bytes / b_us / 1e3:.0f} GB/s ({b_bytes / b_us / 1e3 / gbs:.0%} of the copy) |")  # fmt: skip
    head = ["| kernel, pass | default launch, per step | fastest launch | its time per step | default / fastest | "
            "fastest's bytes/s |", "|---|---|---|---|---|---|"]  # fmt: skip
    return head + lines, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=16384, help="the micro-batch the shapes are captured from")
    ap.add_argument("--preset", type=Path, default=ROOT / "configs/model/gpu_1b.yaml")
    ap.add_argument("--quick", action="store_true", help="the defaults and a few variants only")
    ap.add_argument("--small", action="store_true", help="CPU plumbing: the tiny preset, 64 tokens")
    ap.add_argument("--ops", default="attn_res,conv,adamw", help="which kernels: any of attn_res, conv, adamw")
    args = ap.parse_args()
    ops = set(args.ops.split(","))
    if not ops or not ops <= {"attn_res", "conv", "adamw"}:
        ap.error(f"--ops: any of attn_res, conv, adamw (comma-separated), got {args.ops!r}")
    from learner_mfu import load_arch

    cuda = torch.cuda.is_available() and not args.small
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("learner_kernels: no CUDA device; run with TRITON_INTERPRET=1 --small for the CPU plumbing")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    arch = load_arch(ROOT / "configs/model/cpu_tiny.yaml" if args.small else args.preset)
    tokens = 64 if args.small else args.tokens
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    shapes = capture_shapes(arch, tokens, device)
    time_us = timer(device)
    gbs = copy_gbs(device, time_us)
    D = arch["hidden_size"]
    tensors = [len(k) for k in shapes["adamw"]]
    print(f"[shapes] {dict(shapes['attn_res'])} {dict(shapes['conv'])}, {tensors} parameter tensors; copy {gbs:.0f} "
          f"GB/s", flush=True)  # fmt: skip
    rows = []
    for (S, dtypes), calls in sorted(shapes["attn_res"].items()) if "attn_res" in ops else ():
        case = attn_res_case(S, dtypes, tokens, D, device)
        for v in attn_res_variants(args.quick):
            rows.append({"op": "attn_res", "shape": f"S={S} {'/'.join(d.removeprefix('torch.') for d in dtypes)}",
                         "calls": calls, **run_attn_res(case, v, device, time_us)})  # fmt: skip
            print(f"[attn_res] {rows[-1]}", flush=True)
    for (R, C, K, dtype, silu), calls in sorted(shapes["conv"].items()) if "conv" in ops else ():
        case = conv_case(R, C, K, dtype, device)
        for v in conv_variants(args.quick):
            rows.append({"op": "conv", "shape": f"R={R} C={C} K={K} {dtype.removeprefix('torch.')} silu={silu}",
                         "calls": calls, **run_conv(case, v, silu, time_us)})  # fmt: skip
            print(f"[conv] {rows[-1]}", flush=True)
    for shapes_, calls in shapes["adamw"].items() if "adamw" in ops else ():
        for v in adamw_variants(args.quick):
            rows.append({"op": "adamw", "shape": f"{len(shapes_)} tensors", "calls": calls,
                         **run_adamw(shapes_, v, device, time_us)})  # fmt: skip
            print(f"[adamw] {rows[-1]}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    table, summary = step_table(rows, gbs)
    env = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name() if cuda else platform.processor(),
           "torch": torch.__version__, "command": " ".join(sys.argv), "tokens": tokens, "copy_gbs": gbs,
           "seconds": time.time() - t0}  # fmt: skip
    (args.out / "learner_kernels.json").write_text(json.dumps({"env": env, "summary": summary, "rows": rows}, indent=1))
    md = [f"{env['date']}, {env['device']}, torch {env['torch']}: `{env['command']}`; copy {gbs:.0f} GB/s", "", *table]
    (args.out / "learner_kernels.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"[FAILED check] {r}", flush=True)
    default_of = defaults()
    wrong_default = any(not r["ok"] and launch_key(r) == launch_key(default_of[f"{r['op']} {r['pass']}"]) for r in rows)
    return 0 if rows and not wrong_default else 1


if __name__ == "__main__":
    sys.exit(main())
