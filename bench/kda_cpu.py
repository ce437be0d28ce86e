"""CPU timings of the KDA paths: chunk_kda (fwd, fwd+bwd) against the token-by-token recurrences.

Prints milliseconds and ratios, asserts nothing (the tests check correctness). The peer here is
the step recurrence: naive_recurrent_kda (float64 reference) and fused_recurrent_kda (fp32).
    python bench/kda_cpu.py [--threads N] [--repeat R] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from kernels.kda.chunk import chunked_kda_torch

# (label, B, T, H, K, cu_seqlens lengths or None)
SHAPES = [
    ("B1 T512 H4 K64", 1, 512, 4, 64, None),
    ("B2 T2048 H4 K64", 2, 2048, 4, 64, None),
    ("B1 T4096 H8 K64", 1, 4096, 8, 64, None),
    ("varlen 8x(1..1000) H4 K64", 1, None, 4, 64, [1, 63, 64, 130, 257, 500, 777, 1000]),
    ("decode 32x1 H4 K32", 1, None, 4, 32, [1] * 32),
]


def make(B, T, H, K, dtype, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    xs = {
        "q": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        "v": torch.randn(B, T, H, K, generator=gen),
        "g": F.logsigmoid(2 * torch.randn(B, T, H, K, generator=gen)).clamp(min=-5),
        "beta": torch.sigmoid(torch.randn(B, T, H, generator=gen)),
    }
    return {n: x.to(dtype).requires_grad_(requires_grad) for n, x in xs.items()}


CLOCK = time.perf_counter


def timeit(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best * 1e3


def bench_shape(label, B, T, H, K, lengths, dtype, repeat):
    cu = None
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        T = int(cu[-1])
    x = make(B, T, H, K, dtype)
    xg = make(B, T, H, K, dtype, requires_grad=True)

    def fwd_bwd():
        o, _ = chunk_kda(**xg, cu_seqlens=cu)
        o.float().square().sum().backward()

    ms_chunk = timeit(lambda: chunk_kda(**x, cu_seqlens=cu), repeat)
    ms_chunked = timeit(lambda: chunked_kda_torch(**x, cu_seqlens=cu), repeat)
    ms_chunk_fb = timeit(fwd_bwd, repeat)
    ms_fused = timeit(lambda: fused_recurrent_kda(**x, cu_seqlens=cu), 1)
    ms_naive = timeit(lambda: naive_recurrent_kda(**x, cu_seqlens=cu), 1)
    print(
        f"{label:27s} {str(dtype)[6:]:8s} chunk_kda fwd {ms_chunk:7.1f} ms  fwd+bwd {ms_chunk_fb:7.1f} ms | "
        f"chunked-only fwd {ms_chunked:7.1f} ms | "
        f"fused_recurrent {ms_fused:8.1f} ms ({ms_fused / ms_chunk:5.1f}x) | "
        f"naive f64 {ms_naive:8.1f} ms ({ms_naive / ms_chunk:5.1f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="cpu: process time (shared machines)"
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.clock} clock; ratio = recurrence / chunk_kda fwd"
    )
    print("(chunk_kda sends sequences of <= 16 tokens to the recurrence; chunked-only forces chunks)")
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            bench_shape(*shape, dtype=dtype, repeat=args.repeat)


if __name__ == "__main__":
    main()
