"""A decode step's expert GEMMs: our small-rows Triton kernel against torch's CUTLASS grouped product.

``kernels.moe.triton.grouped_mm_small`` (what ``grouped_mm_forward`` runs up to ``SMALL_ROWS_MAX`` rows) and
``torch._grouped_mm`` on gpu_1b's two expert products (gate/up [128, 512, 512] and down [128, 512, 256], bf16),
rows laid out by ``kernels.moe.route_layout`` from random top-8 routes of T tokens. Per size: the error of ours
against CUTLASS (relative Frobenius, over the rows both compute) and each kernel's microseconds a call inside a
replayed CUDA graph (10 calls a graph; a decode step runs its GEMMs in one), with the weight bytes a call reads
over that time. CUDA only.

    python3 bench/grouped_mm_decode.py [--out DIR]   # DIR/grouped_mm_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from moe_compile import time_graph_replays

from kernels.moe import grouped_mm_alignment, route_layout
from kernels.moe.triton import grouped_mm_small

EXPERTS, TOP_K, Z, I = 128, 8, 512, 256  # gpu_1b (configs/model/gpu_1b.yaml)


def graph_us(fn, calls: int = 10, reps: int = 200) -> float:
    """Microseconds a call of ``fn`` inside a replayed CUDA graph of ``calls`` calls (``moe_compile``'s
    replay timing, over several calls a graph so that a replay's own launch is spread thin)."""
    ms = time_graph_replays(lambda: [fn() for _ in range(calls)], reps, torch.device("cuda"))
    return ms * 1e3 / calls


def one_size(tokens: int, n: int, k: int) -> dict:
    dev = torch.device("cuda")
    experts = torch.stack([torch.randperm(EXPERTS, device=dev)[:TOP_K] for _ in range(tokens)])
    lay = route_layout(experts, EXPERTS, grouped_mm_alignment(dev, torch.bfloat16))
    x = torch.randn(lay.rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
    cutlass = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=lay.offs_E)
    small = lambda: grouped_mm_small(x, w, lay.offs_E)
    used = int(lay.offs_E[-1])
    ref, got = cutlass()[:used].float(), small()[:used].float()
    us_c, us_s = graph_us(cutlass), graph_us(small)
    gb = w.numel() * w.element_size() / 1e9
    return dict(tokens=tokens, rows=lay.rows, n=n, k=k, rel_err=((got - ref).norm() / ref.norm()).item(),
                cutlass_us=us_c, small_us=us_s, cutlass_tb_s=gb / us_c * 1e3, small_tb_s=gb / us_s * 1e3,
                speedup=us_c / us_s)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/grouped_mm_decode")))
    p.add_argument("--tokens", default="8,64,128,256,512", help="decode batch sizes, comma-separated")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_mm_decode: needs a CUDA GPU (the kernels are compared in CUDA graphs)")
    torch.manual_seed(0)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        for n, k in ((2 * I, Z), (Z, I)):
            r = one_size(t, n, k)
            rows.append(r)
            print(f"T={t} rows={r['rows']} [{n} x {k}]: rel err {r['rel_err']:.2e}; us a call in a graph: CUTLASS "
                  f"{r['cutlass_us']:.1f} ({r['cutlass_tb_s']:.2f} TB/s of weights), small-rows Triton "
                  f"{r['small_us']:.1f} ({r['small_tb_s']:.2f} TB/s): {r['speedup']:.2f}x", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"))
    (args.out / "grouped_mm_decode.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))


if __name__ == "__main__":
    main()
