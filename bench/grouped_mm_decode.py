"""A decode step's expert GEMMs: our small-rows Triton kernel against torch's CUTLASS grouped product.

``kernels.moe.triton.grouped_mm_small`` (what ``grouped_mm_forward`` runs up to ``SMALL_ROWS_MAX`` rows) and
``torch._grouped_mm`` on gpu_1b's two expert products (gate/up [128, 512, 512] and down [128, 512, 256], bf16),
rows laid out by ``kernels.moe.route_layout`` from random top-8 routes of T tokens. Per size: the error of ours
against CUTLASS (relative Frobenius, over the rows both compute) and each kernel's microseconds a call inside a
replayed CUDA graph (10 calls a graph; a decode step runs its GEMMs in one), with the weight bytes a call reads
over that time. ``--sweep``: our kernel's launch (``SmallTiles``: tile rows, columns and k, warps, pipeline stages)
over a grid at the decode sizes, each checked against CUTLASS, the fastest listed beside the default. ``--layout``:
the route layout before the GEMMs, the engine's two-launch ``route_tensors_small`` against ``route_tensors`` compiled
(what the engine's MoE block ran before it; past 128 tokens, a prefill step's, ``route_tensors_large`` against
the eager sort path), the router's top-k, ``top_experts_small`` against the sort, and its whole selection from the
logits, ``select_experts_small`` against the gate's steps (compiled; eager past 128 tokens), each in a graph and
issued eagerly (the host's launches included).
``--situ``: the permute, the gate/up product and the SiTU activation in one launch (``permute_situ_small``) against
the three steps. CUDA only.

    python3 bench/grouped_mm_decode.py [--out DIR]           # DIR/grouped_mm_decode.json
    python3 bench/grouped_mm_decode.py --sweep --tokens 64   # DIR/grouped_mm_decode_sweep.json
    python3 bench/grouped_mm_decode.py --layout --tokens 64,16384  # DIR/grouped_mm_decode_layout.json
    python3 bench/grouped_mm_decode.py --situ --tokens 8,64,128  # DIR/grouped_mm_decode_situ.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from moe_compile import time_graph_replays

from kernels.glu import situ_glu_reference
from kernels.moe import grouped_mm_alignment, route_layout, route_tensors
from kernels.moe.triton import (
    ROUTE_SMALL_MAX,
    SmallTiles,
    grouped_mm_small,
    permute_situ_small,
    route_tensors_large,
    route_tensors_small,
    select_experts_small,
    situ_tiles,
    small_tiles,
    top_experts_small,
)
from model.moe import select_experts, top_experts

EXPERTS, TOP_K, Z, I = 128, 8, 512, 256  # gpu_1b (configs/model/gpu_1b.yaml)


def graph_us(fn, calls: int = 10, reps: int = 200) -> float:
    """Microseconds a call of ``fn`` inside a replayed CUDA graph of ``calls`` calls (``moe_compile``'s
    replay timing, over several calls a graph so that a replay's own launch is spread thin)."""
    ms = time_graph_replays(lambda: [fn() for _ in range(calls)], reps, torch.device("cuda"))
    return ms * 1e3 / calls


# the launches ``--sweep`` tries: (BM, BN, BK) x (warps, stages)
SWEEP_TILES = [(16, bn, bk) for bn in (32, 64, 128) for bk in (64, 128, 256)] + [(32, 64, 64), (32, 64, 128)]
SWEEP_WARPS_STAGES = [(4, 2), (4, 3), (4, 4), (8, 3)]
L2_BYTES = 60 << 20  # more than an H100's or H200's L2 (50 MB)


def random_routes(tokens: int, dev: torch.device) -> torch.Tensor:
    """[tokens, TOP_K] distinct random experts a token."""
    return torch.rand(tokens, EXPERTS, device=dev).argsort(dim=1)[:, :TOP_K].contiguous()


def issued_us(fn, calls: int = 50) -> float:
    """Microseconds a call of ``fn`` issued back to back outside any graph, the host's launch work included (the
    larger of the host's and the device's time a call): what an engine step that runs eagerly (a prefill) pays."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def problem(tokens: int, n: int, k: int):
    """gpu_1b's expert product at a decode batch: rows laid out from random top-8 routes, bf16 weights, and
    torch's CUTLASS product of them (the reference)."""
    dev = torch.device("cuda")
    lay = route_layout(random_routes(tokens, dev), EXPERTS, grouped_mm_alignment(dev, torch.bfloat16))
    x = torch.randn(lay.rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
    return lay, x, w, lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=lay.offs_E)


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def one_size(tokens: int, n: int, k: int) -> dict:
    lay, x, w, cutlass = problem(tokens, n, k)
    small = lambda: grouped_mm_small(x, w, lay.offs_E)
    used = int(lay.offs_E[-1])
    us_c, us_s = graph_us(cutlass), graph_us(small)
    gb = w.numel() * w.element_size() / 1e9
    return dict(tokens=tokens, rows=lay.rows, n=n, k=k, rel_err=rel_err(cutlass()[:used], small()[:used]),
                cutlass_us=us_c, small_us=us_s, cutlass_tb_s=gb / us_c * 1e3, small_tb_s=gb / us_s * 1e3,
                speedup=us_c / us_s)  # fmt: skip


def sweep(tokens: int, n: int, k: int) -> dict:
    """Our kernel's launches (``SWEEP_TILES`` x ``SWEEP_WARPS_STAGES``) on one product: each checked against
    CUTLASS (a launch off by more than bf16 rounding, or failing to compile, is reported and not ranked), then
    timed in a replayed graph; the rows sorted fastest first, the default's (``small_tiles``) time and rank beside."""
    lay, x, w, cutlass = problem(tokens, n, k)
    used = int(lay.offs_E[-1])
    ref = cutlass()[:used]
    gb = w.numel() * w.element_size() / 1e9
    copies = weight_copies(w)
    rows, failed = [], []
    for (bm, bn, bk), (warps, stages) in itertools.product(SWEEP_TILES, SWEEP_WARPS_STAGES):
        tiles = SmallTiles(bm, bn, bk, warps, stages)
        fn = over_copies(copies, lambda w_, t=tiles: grouped_mm_small(x, w_, lay.offs_E, t))
        try:
            err = rel_err(ref, grouped_mm_small(x, w, lay.offs_E, tiles)[:used])
        except Exception as e:  # e.g. out of shared memory: the launch is not a candidate
            failed.append(dict(**asdict(tiles), error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        if err > 1e-2:
            failed.append(dict(**asdict(tiles), error=f"relative error {err:.2e} against CUTLASS"))
            continue
        us = graph_us(fn)
        rows.append(dict(**asdict(tiles), us=us, tb_s=gb / us * 1e3, rel_err=err))
    rows.sort(key=lambda r: r["us"])
    default = asdict(small_tiles(lay.rows))
    rank = next((i for i, r in enumerate(rows) if all(r[f] == v for f, v in default.items())), None)
    cutlass = over_copies(copies, lambda w_: torch._grouped_mm(x, w_.transpose(-2, -1), offs=lay.offs_E))
    return dict(tokens=tokens, rows=lay.rows, n=n, k=k, cutlass_us=graph_us(cutlass), default=default,
                default_rank=rank, default_us=None if rank is None else rows[rank]["us"], launches=rows,
                failed=failed)  # fmt: skip


def layout(tokens: int) -> dict:
    """The route layout of ``tokens`` random top-8 routes, the router's top-k and its whole selection: the engine's
    Triton launches against what they replace, the same groups / experts, us a call in a graph and issued eagerly.
    Up to ``ROUTE_SMALL_MAX`` slots (a decode step, replayed in the engine's CUDA graphs) against the compiled steps
    (the layout with counting ranks, as the engine's compiled block traced it); past it (a prefill step, run
    eagerly) the three-launch layout and the one-launch selection against the eager steps the engine's ops ran
    there before (the layout ranking by sort)."""
    dev = torch.device("cuda")
    experts = random_routes(tokens, dev)
    align = grouped_mm_alignment(dev, torch.bfloat16)
    decode = tokens * TOP_K <= ROUTE_SMALL_MAX
    if decode:
        compiled = torch.compile(route_tensors, dynamic=False)
        ref_layout = lambda: compiled(experts, EXPERTS, align, 1 << 25)
    else:
        ref_layout = lambda: route_tensors(experts, EXPERTS, align, 0)
    ours = route_tensors_small if decode else route_tensors_large
    fast_layout = lambda: ours(experts, EXPERTS, align)
    row = dict(tokens=tokens, slots=tokens * TOP_K, reference="compiled" if decode else "eager",
               equal=same_groups(ref_layout(), fast_layout()))  # fmt: skip
    # the router's top-k before it: the sort the compiled block calls (``model.moe.top_experts``) and the kernel
    scores = torch.rand(tokens, EXPERTS, device=dev)
    sort, top = lambda: top_experts(scores, TOP_K), lambda: top_experts_small(scores, TOP_K)
    row["top_equal"] = all(torch.equal(a, b) for a, b in zip(sort(), top(), strict=True))
    # the whole selection from the logits: the gate's sigmoid, sort and weights, against the one launch
    logits, bias = 3 * torch.randn(tokens, EXPERTS, device=dev), 0.1 * torch.randn(EXPERTS, device=dev)
    steps = torch.compile(select_experts, dynamic=False) if decode else select_experts  # gpu_1b: renormalised
    gate = lambda: steps(logits, bias, TOP_K, True, 1.0)
    select = lambda: select_experts_small(logits, bias, TOP_K, True, 1.0)
    row["select_equal"] = torch.equal(gate()[0], select()[0])
    for name, ref, fast in (("layout", ref_layout, fast_layout), ("top", sort, top), ("select", gate, select)):
        for how, timer in (("graph", graph_us), ("issued", issued_us)):
            r, f = timer(ref), timer(fast)
            row[f"{name}_{how}_us"] = dict(reference=r, ours=f, speedup=r / f)
    return row


def same_groups(want: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> bool:
    """Two route layouts with the same group ends and, in every group, the same tokens (in any row order)."""
    (src_w, _, offs_w), (src_g, rows_g, offs_g) = want, got
    if not torch.equal(offs_w, offs_g) or not torch.equal(src_g[rows_g], src_w[want[1]]):
        return False
    ends = offs_w.tolist()
    return all(torch.equal(src_w[a:b].sort().values, src_g[a:b].sort().values) for a, b in zip([0, *ends], ends))


# the fused SiTU kernel's launches ``--situ`` tries beside its default (``situ_tiles``)
SITU_LAUNCHES = [SmallTiles(bn=16), SmallTiles(bn=32, stages=2), SmallTiles(bn=64), SmallTiles(bn=32, bk=128),
                 SmallTiles(bm=32, bn=32)]  # fmt: skip


def situ(tokens: int) -> dict:
    """The experts up to the down product: ``permute_situ_small`` (one launch) against the three steps it replaces
    as the engine's compiled block ran them (the permute compiled, our grouped GEMM, the activation compiled), on
    gpu_1b's gate/up weights cycled over copies larger than L2; the error of each launch against the three steps,
    us a call."""
    dev = torch.device("cuda")
    lay = route_layout(random_routes(tokens, dev), EXPERTS, grouped_mm_alignment(dev, torch.bfloat16))
    z = torch.randn(tokens, Z, device=dev, dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, 2 * I, Z, device=dev, dtype=torch.bfloat16) * Z**-0.5
    copies = weight_copies(w)
    gather = torch.compile(lambda z_, src: torch.nn.functional.pad(z_, (0, 0, 0, 1)).index_select(0, src))
    act = torch.compile(lambda gu: situ_glu_reference(*gu.chunk(2, dim=-1)))

    def three(w_):
        return act(grouped_mm_small(gather(z, lay.src_row_P), w_, lay.offs_E))

    used = int(lay.offs_E[-1])
    ref = three(w)[:used]
    row = dict(tokens=tokens, rows=lay.rows, three_us=graph_us(over_copies(copies, three)), launches=[])
    for tiles in [situ_tiles(lay.rows), *SITU_LAUNCHES]:
        fused = lambda w_, t=tiles: permute_situ_small(z, lay.src_row_P, lay.offs_E, w_, 4.0, 25.0, t)
        err = rel_err(ref, fused(w)[:used])
        row["launches"].append(dict(**asdict(tiles), us=graph_us(over_copies(copies, fused)), rel_err=err))
    row["default_us"] = row["launches"][0]["us"]
    row["speedup"] = row["three_us"] / row["default_us"]
    return row


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """``w`` and clones of it, more bytes together than L2: timed calls cycle through them (``over_copies``), as a
    step's layers read weights the cache does not hold."""
    return [w] + [w.clone() for _ in range(max(1, -(-L2_BYTES // (w.numel() * w.element_size()))))]


def over_copies(copies: list[torch.Tensor], call):
    """A function calling ``call`` with the next of ``copies`` each time (the weights of successive layers)."""
    ws = itertools.cycle(copies)
    return lambda: call(next(ws))


def print_sweep(r: dict, top: int = 6) -> None:
    print(f"T={r['tokens']} rows={r['rows']} [{r['n']} x {r['k']}]: CUTLASS {r['cutlass_us']:.1f} us; default "
          f"{r['default_us']} us (rank {r['default_rank']} of {len(r['launches'])}); {len(r['failed'])} failed",
          flush=True)  # fmt: skip
    for x in r["launches"][:top]:
        print(f"  BM {x['bm']} BN {x['bn']} BK {x['bk']} warps {x['warps']} stages {x['stages']}: {x['us']:.1f} us "
              f"({x['tb_s']:.2f} TB/s of weights)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/grouped_mm_decode")))
    p.add_argument("--tokens", default="8,64,128,256,512", help="decode batch sizes, comma-separated")
    p.add_argument("--sweep", action="store_true", help="time our kernel's launches over a grid (module docstring)")
    p.add_argument("--layout", action="store_true", help="time the decode route layout's kernel (module docstring)")
    p.add_argument("--situ", action="store_true", help="time the fused permute + gate/up + SiTU (module docstring)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_mm_decode: needs a CUDA GPU (the kernels are compared in CUDA graphs)")
    torch.manual_seed(0)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.layout:
        res = []
        for t in (int(v) for v in args.tokens.split(",")):
            res.append(layout(t))
            r = res[-1]
            times = "; ".join(f"{k[:-3]} {v['reference']:.1f} -> {v['ours']:.1f} us ({v['speedup']:.2f}x)"
                              for k, v in r.items() if k.endswith("_us"))  # fmt: skip
            print(f"T={t} ({r['slots']} slots, against the {r['reference']} steps): layout equal {r['equal']}, "
                  f"top-{TOP_K} equal {r['top_equal']}, selection equal {r['select_equal']}; {times}", flush=True)
        (args.out / "grouped_mm_decode_layout.json").write_text(json.dumps(dict(env=env, sizes=res), indent=1))
        return
    if args.situ:
        res = []
        for t in (int(v) for v in args.tokens.split(",")):
            res.append(situ(t))
            r = res[-1]
            best = min(r["launches"], key=lambda x: x["us"])
            print(f"T={t} rows={r['rows']}: three steps {r['three_us']:.1f} us, one launch {r['default_us']:.1f} us "
                  f"({r['speedup']:.2f}x, rel err {r['launches'][0]['rel_err']:.1e}); best launch {best}",
                  flush=True)  # fmt: skip
        (args.out / "grouped_mm_decode_situ.json").write_text(json.dumps(dict(env=env, sizes=res), indent=1))
        return
    if args.sweep:
        res = []
        for t in (int(v) for v in args.tokens.split(",")):
            for n, k in ((2 * I, Z), (Z, I)):
                res.append(sweep(t, n, k))
                print_sweep(res[-1])
                (args.out / "grouped_mm_decode_sweep.json").write_text(json.dumps(dict(env=env, sizes=res), indent=1))
        return
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        for n, k in ((2 * I, Z), (Z, I)):
            r = one_size(t, n, k)
            rows.append(r)
            print(f"T={t} rows={r['rows']} [{n} x {k}]: rel err {r['rel_err']:.2e}; us a call in a graph: CUTLASS "
                  f"{r['cutlass_us']:.1f} ({r['cutlass_tb_s']:.2f} TB/s of weights), small-rows Triton "
                  f"{r['small_us']:.1f} ({r['small_tb_s']:.2f} TB/s): {r['speedup']:.2f}x", flush=True)  # fmt: skip
    (args.out / "grouped_mm_decode.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))


if __name__ == "__main__":
    main()
