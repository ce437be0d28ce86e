"""The fused SiTU-GLU kernels (``kernels.glu``) at the learner's shapes, against inductor's compile of the
reference and against a variant of the forward kernel, to say where the kernel's time goes.

    python bench/glu_kernel.py --out DIR          # a GPU
    python bench/glu_kernel.py --small --out DIR  # the plumbing on a CPU (Triton interpreter, tiny shapes)

Why: in the H200 learner step (bench/RESULTS.md, "Learner throughput and MFU") the SiTU-GLU forward took
240-320 us a call on the routed experts' rows, several times what reading gate and up and writing h costs
at the H200's memory bandwidth. Per shape (gpu_1b at 16,384 tokens: the routed experts' 131,072 rows of 256,
the shared expert's 16,384 rows of 256, the dense layer's 16,384 rows of 3,072; gate and up the two halves
of one [R, 2C] bf16 buffer, as the grouped path passes them):

* ``ours``: the kernels the learner runs, forward and backward (``kernels.glu.triton``), called eagerly;
* ``ours_compiled``: the same called from a ``torch.compile``d function with a dynamic row count, as the
  learner's compiled MoE blocks call it (the kernels are custom ops: inductor calls them as they are; when
  inductor traced the kernel and launched it itself, its calls in the step took 321 us against 87 us for
  the eager ones);
* ``inductor``: ``torch.compile`` of the reference (``situ_glu_reference``), forward and backward;
* ``libdevice`` (CUDA only): our forward with libdevice's tanh and sigmoid in place of the exp-and-divide
  forms (which the interpreter needs): what the transcendental math costs.

Each is checked against the fp64 reference on the same inputs first (error ratio, ``kernels.testing``), then
timed two ways over ``--iters`` calls: ``*_us``, the kernels' own device time a call (``torch.profiler``; the
bandwidth column is bytes read and written over it), and ``*_call_us``, CUDA events around each call (median),
which on the H200's slow hosts is the host's launch path, not the kernel: the first run timed our forward at
173 us a call that way, where the learner step's profile gave the same kernel 58-80 us. Results:
``DIR/glu_kernel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"routed": (131072, 256), "shared": (16384, 256), "dense": (16384, 3072)}
SMALL_SHAPES = {"routed": (40, 24), "dense": (9, 70)}
BETAS = (4.0, 25.0)
if "--small" in sys.argv:  # before triton is imported: the interpreter
    os.environ["TRITON_INTERPRET"] = "1"


import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import libdevice  # noqa: E402

from kernels.glu.triton import BLOCK_C, BLOCK_R  # noqa: E402


# the exploration variant of the forward kernel lives here, not in ``kernels.glu``: a measurement; the
# production kernel changes once a variant wins
@triton.jit
def _fwd_variant(g_ptr, u_ptr, h_ptr, R, C, g_stride, u_stride, inv_beta, beta, inv_lb, lb,
                 BR: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row0 = tl.program_id(0).to(tl.int64) * BR  # the program's first row, 64-bit; offsets inside it 32-bit
    rows = tl.arange(0, BR)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (row0 + rows < R) & (cols < C)
    g = tl.load(g_ptr + row0 * g_stride + rows * g_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row0 * u_stride + rows * u_stride + cols, mask=m, other=0.0).to(tl.float32)
    a = beta * libdevice.tanh(g * inv_beta)
    s = tl.sigmoid(g)
    b = lb * libdevice.tanh(u * inv_lb)
    tl.store(h_ptr + row0 * C + rows * C + cols, (a * s * b).to(h_ptr.dtype.element_ty), mask=m)


def forward_libdevice(g, u):
    R, C = g.shape
    h = g.new_empty(R, C)
    beta, lb = BETAS
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(C, BLOCK_C))
    _fwd_variant[grid](g, u, h, R, C, g.stride(0), u.stride(0), 1.0 / beta, beta, 1.0 / lb, lb,
                       BR=BLOCK_R, BLOCK=BLOCK_C)  # fmt: skip
    return h


def kernel_time(fn, iters: int) -> float:
    """Microseconds of device time a call of ``fn()`` spends in kernels (CUDA; after ``time_call``'s warm-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    # the kernels carry their own device time; an operator's self device time is 0 (as bench/learner_mfu.py)
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return device_us / iters


def time_call(fn, iters: int, cuda: bool) -> float:
    """Median microseconds of ``fn()`` (CUDA events on a GPU, wall clock elsewhere), after 3 warm-up calls."""
    import time

    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure_shape(name: str, R: int, C: int, iters: int, device: str) -> dict:
    import torch

    from kernels.glu import situ_glu_reference
    from kernels.glu.triton import SituGLU
    from kernels.testing import error_ratio

    cuda = device == "cuda"
    torch.manual_seed(0)
    gu = (torch.randn(R, 2 * C, device=device) * 3).to(torch.bfloat16)
    g, u = gu.chunk(2, dim=-1)
    dh = torch.randn(R, C, device=device).to(torch.bfloat16)
    want = situ_glu_reference(g.double(), u.double(), *BETAS)
    compiled = torch.compile(situ_glu_reference, dynamic=False)
    ours_compiled = torch.compile(lambda g, u: SituGLU.apply(g, u, *BETAS), dynamic=True)
    forwards = {
        "ours": lambda: SituGLU.apply(g, u, *BETAS),
        "ours_compiled": lambda: ours_compiled(g, u),
        "inductor": lambda: compiled(g, u, *BETAS),
    }
    if cuda:
        forwards["libdevice"] = lambda: forward_libdevice(g, u)
    row = {"shape": [R, C], "error": {}, "forward_us": {}, "forward_call_us": {}, "backward_us": {},
           "backward_call_us": {}}  # fmt: skip

    def timed(direction: str, kind: str, fn) -> None:
        row[f"{direction}_call_us"][kind] = round(time_call(fn, iters, cuda), 1)
        row[f"{direction}_us"][kind] = round(kernel_time(fn, iters), 1) if cuda else None

    for kind, fn in forwards.items():
        row["error"][kind] = round(error_ratio(want, fn().double()), 6)
        timed("forward", kind, fn)
    leaf = gu.detach().requires_grad_()
    for kind, fn in (("ours", SituGLU.apply), ("inductor", compiled)):
        h = fn(*leaf.chunk(2, dim=-1), *BETAS)

        def backward(h=h):
            return torch.autograd.grad(h, leaf, dh, retain_graph=True)

        timed("backward", kind, backward)
    io_bytes = 3 * R * C * gu.element_size()  # g and u read, h written
    row["forward_gb_per_s"] = {k: round(io_bytes / us / 1e3, 1) for k, us in row["forward_us"].items() if us}
    print(f"{name} {R}x{C}: forward " + ", ".join(
        f"{k} {row['forward_us'][k]} us kernel / {row['forward_call_us'][k]} us call (error {row['error'][k]})"
        for k in forwards) + " | backward " + ", ".join(
        f"{k} {row['backward_us'][k]} / {row['backward_call_us'][k]} us" for k in row["backward_us"]), flush=True)  # fmt: skip
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/glu_kernel")))
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU through the Triton interpreter")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    if device == "cpu" and not args.small:
        raise SystemExit("no GPU: run with --small for the plumbing on a CPU")
    shapes = SMALL_SHAPES if args.small else SHAPES
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "shapes": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (R, C) in shapes.items():
        report["shapes"][name] = measure_shape(name, R, C, 3 if args.small else args.iters, device)
        (args.out / "glu_kernel.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
