"""The learner's peak GPU memory per train step, predicted on the CPU: no GPU, no data, no arithmetic.

The learner's real train step (forward with routing replay, chunked LM head with entropy, a policy-gradient
loss, backward, clip, fused AdamW; bf16 autocast, fp32 master weights and optimizer state) runs on fake
tensors (``FakeTensorMode``: shapes, dtypes and storages, no values) under CPU autocast in bf16, with the
code paths CUDA takes patched in where the CPU would take another (``cuda_code_paths``):

* ``model.fast.pick`` resolves "auto" as on CUDA (grouped MoE, varlen flash attention, Triton conv,
  chunked LM head, Triton SiTU-GLU, recompute paths);
* every Triton kernel launch is a no-op, so the Triton autograd Functions (KDA core, conv, SiTU-GLU)
  allocate and save exactly what they do on the GPU; ``kernels.kda.chunk_kda`` takes the Triton path;
* PyTorch's varlen flash attention runs as its own op (its fake kernel: the outputs and saved tensors of
  the CUDA one); ``F.rms_norm`` as the fused CUDA kernel (``_FusedRMSNorm``: keeps x and the fp32 rstd),
  the KDA L2 norm in its fused CUDA form, SiTU-GLU as the Triton Function (``GatedActivation.glu``
  tests ``is_cuda``, which a CPU tensor fails);
* grouped-GEMM groups padded to 16 bytes of rows (``grouped_mm_alignment`` on CUDA).

``LiveMemory`` (a dispatch mode) counts every storage an op creates, rounded up to the CUDA caching
allocator's 512 bytes, until Python frees it: what ``torch.cuda.max_memory_allocated`` counts, less the
allocator's unsplit block tails and cuBLAS / flash-attention workspaces (a few MiB). Step 1 creates the
AdamW state; the peak of step 2 is reported (the bench reports the max over its timed steps after two
warm-up steps), with what is live at the end of the forward (everything kept for backward: saved tensors,
checkpointed regions' inputs and custom Functions' ``ctx`` attributes alike, which the saved-tensor ledger
of ``bench/learner_mfu.py --memory-breakdown`` does not see) and at the peak (taken in step 3 at step 2's
peak event: the same allocations), per layer kind and sub-module. Batch tensors the GPU learner copies to
the device (token ids, replayed routes, masks; ~16 MiB at 16K tokens) stay real host tensors here and are
not counted. Against the H200 (bench/RESULTS.md, the d37b20f run; predicted at 5ed528d, which changed
nothing since that moves memory): 42.23 GiB predicted, 42.3 GiB measured at 16K tokens; 131.92 against
132.0 GiB at 64K.

    python bench/learner_memory.py --tokens 16384,65536       # gpu_1b, ~30 s a size on 2 CPU cores
    python bench/learner_memory.py --tokens 16384 --micro-batches 2       # gradients accumulated
    python bench/learner_memory.py --tokens 16384 --fast-paths moe=loop   # any model.fast spec

Results: ``<out>/learner_memory.json`` and a markdown summary on stdout (and ``learner_memory.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.learner_mfu import episode_lengths, load_arch, make_batch  # noqa: E402

BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this
GiB = 2**30


@dataclass
class Alloc:
    nbytes: int
    phase: str
    site: str
    dtype: str
    shape: str


class LiveMemory(TorchDispatchMode):
    """Bytes of live storages created by ops under this mode: the running total, its peak (and the event
    number of the peak), and on request what is live at a given event number."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Alloc] = {}
        self.total = self.peak = self.events = 0
        self.peak_event, self.peak_phase = -1, ""
        self.phase, self.site = "setup", ["(outside)"]
        self.snap_event: int | None = None
        self.on_snapshot = lambda live: dict(live)  # classified while those storages are alive
        self.snapshot = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live or st.nbytes() == 0:
            return
        nbytes = -(-st.nbytes() // BLOCK) * BLOCK
        dtype = str(t.dtype).replace("torch.", "")
        self.live[key] = Alloc(nbytes, self.phase, self.site[-1], dtype, "x".join(map(str, t.shape)))
        weakref.finalize(st, self._free, key)
        self.total += nbytes
        self.events += 1
        if self.total > self.peak:
            self.peak, self.peak_event, self.peak_phase = self.total, self.events, self.phase
        if self.events == self.snap_event:
            self.snapshot = self.on_snapshot(self.live)

    def _free(self, key: int) -> None:
        a = self.live.pop(key, None)
        if a is not None:
            self.total -= a.nbytes

    def reset_peak(self) -> None:
        self.peak, self.peak_event, self.peak_phase = self.total, self.events, self.phase

    @contextlib.contextmanager
    def module_sites(self, model: torch.nn.Module):
        """Name each allocation after the innermost module running (forward, and recomputation in backward)."""
        names = {m: n for n, m in model.named_modules()}

        def pre(mod, args):
            self.site.append(names.get(mod, type(mod).__name__))

        def post(mod, args, out):
            self.site.pop()

        hooks = [
            h
            for m in model.modules()
            for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))
        ]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


# ------------------------------------------------------------------------------------------ CUDA code paths
class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm as memory sees it: keeps x and the fp32 rstd, returns dx and dw."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        dims = tuple(range(-len(shape), 0))
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + (eps or 1e-6))
        ctx.save_for_backward(x, weight, rstd)
        y = (x * rstd).to(x.dtype)
        return y * weight if weight is not None else y

    @staticmethod
    def backward(ctx, dy):
        x, weight, _rstd = ctx.saved_tensors
        dw = None if weight is None else torch.empty_like(weight)
        return torch.empty_like(x), None, dw, None


def _fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(x, tuple(normalized_shape), weight, eps)


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def cuda_code_paths(bounds: list[list[int]]):
    """The CUDA learner's code paths on CPU fake tensors (module docstring). ``bounds[0]``: the host
    cu_seqlens of the batch running now (the KDA layer primes its chunk plan from it on CUDA)."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    import kernels.kda as kda_pkg
    import kernels.moe as moe_pkg
    import model.layers as layers
    import model.modeling as modeling
    from kernels.kda.triton import chunk_kda_triton
    from kernels.kda.triton.common import plan_chunks
    from model import fast
    from rl.learner import Learner

    real_pick, real_glu = fast.pick, layers.GatedActivation.glu
    cuda = torch.device("cuda")

    def pick(op, device, dtype=None):
        return real_pick(op, cuda, dtype)

    def glu(self, g, u):
        if fast.pick("glu", g.device) == "triton" and self.act == "situ" and torch.is_grad_enabled():
            from kernels.glu import situ_glu_fused

            return situ_glu_fused(g, u, *self.situ_betas)
        return real_glu(self, g, u)

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  **_):  # fmt: skip
        if cu_seqlens is not None:
            plan_chunks(q.shape[0], q.shape[1], cu_seqlens, q.device, bounds=bounds[0])
        return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)

    def no_launch(kernel, grid):
        if isinstance(kernel, Autotuner) and not hasattr(kernel, "best_config"):
            kernel.best_config = kernel.configs[0]  # read after a launch (kernels.kda.triton.bwd)
        return lambda *a, **k: None

    def on_host(fn):  # host checks of the batch's real tensors (fake mode would fake them)
        def run(*a, **k):
            with unset_fake_temporarily():
                return fn(*a, **k)

        return run

    def align(device, dtype):
        return max(1, 16 // torch.empty((), dtype=dtype).element_size())

    with contextlib.ExitStack() as stack:
        for obj, name, value in (
            (fast, "pick", pick),
            (KernelInterface, "__getitem__", no_launch),
            (kda_pkg, "chunk_kda", chunk_kda),
            (layers, "_l2_normalize", layers.l2_normalize_fused),
            (layers.GatedActivation, "glu", glu),
            (F, "rms_norm", _fused_rms_norm),
            (moe_pkg, "grouped_mm_alignment", align),
            (modeling, "check_replay_ids", on_host(modeling.check_replay_ids)),
            (Learner, "_autocast", lambda self: torch.autocast("cpu", dtype=torch.bfloat16)),
        ):
            stack.enter_context(_patched(obj, name, value))
        yield


# ------------------------------------------------------------------------------------------ the step
def build_learner(arch: dict, tokens: int, fast_paths: str, checkpoint: str):
    from bench.learner_mfu import make_learner

    args = SimpleNamespace(checkpoint=checkpoint, compile=False, compile_scope="regions")
    real_to = torch.nn.Module.to

    def to(module, *a, **k):  # fake parameters cannot be swapped (module.to's path for them): already there
        if not k and len(a) == 1 and torch.device(a[0]).type == "cpu":
            return module
        return real_to(module, *a, **k)

    with _patched(torch.nn.Module, "to", to):
        learner = make_learner(arch, "cpu", "bfloat16", tokens, args, fast_paths)
    params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    learner.optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=True)  # the GPU learner's
    return learner


def train_step(learner, batch, mem: LiveMemory, micro_batches: int = 1) -> None:
    """``Learner._update`` over ``micro_batches`` copies of ``batch`` (gradients accumulated, then one clip and
    AdamW step), with a plain weighted-logprob loss: the rl.losses objective reads metrics on the host (no
    values here); its [T] tensors are a few MiB at most. ``mem.forward_end``: the last micro-batch's."""
    learner.policy.train()
    learner.optimizer.zero_grad(set_to_none=True)
    for _ in range(micro_batches):
        mem.phase = "forward"
        fwd = learner.forward(batch, need_entropy=True)
        w_T = batch.token_weights_T.to(learner.device)
        loss = -(w_T * torch.exp(fwd.logprobs_T - fwd.logprobs_T.detach())).sum()
        mem.phase = "backward"
        mem.forward_end = mem.on_snapshot(mem.live)
        with learner._paths():
            loss.backward()
        del fwd, loss
    mem.phase = "optimizer"
    learner._clip_and_step()
    mem.phase = "idle"


# ------------------------------------------------------------------------------------------ report
def _kind_site(site: str, kinds: dict[int, str]) -> str:
    parts = site.split(".")
    if len(parts) >= 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return f"{kinds[int(parts[2])]} / {'.'.join(parts[3:]) or '(layer)'}"
    return site


def classify(live: dict[int, Alloc], learner, kinds: dict[int, str]) -> dict:
    """Bytes of ``live`` per category (parameters, gradients, AdamW state, the rest per phase and site)."""
    ids = {"parameters": set(), "gradients": set(), "AdamW state": set()}
    for p in learner.base_model.parameters():
        ids["parameters"].add(id(p.untyped_storage()))
        if p.grad is not None:
            ids["gradients"].add(id(p.grad.untyped_storage()))
    for b in learner.base_model.buffers():
        ids["parameters"].add(id(b.untyped_storage()))
    for state in learner.optimizer.state.values():
        ids["AdamW state"].update(
            id(t.untyped_storage()) for t in state.values() if isinstance(t, torch.Tensor)
        )
    totals: dict[str, int] = {}
    sites: dict[str, int] = {}
    tensors: dict[tuple, list[int]] = {}
    for key, a in live.items():
        cat = next((c for c, s in ids.items() if key in s), None)
        if cat is None:
            cat = f"{a.phase}: activations and temporaries"
            site = f"{a.phase} / {_kind_site(a.site, kinds)}"
            sites[site] = sites.get(site, 0) + a.nbytes
            row = tensors.setdefault((site, a.dtype, a.shape), [0, 0])
            row[0] += 1
            row[1] += a.nbytes
        totals[cat] = totals.get(cat, 0) + a.nbytes
    return {
        "total_gib": sum(totals.values()) / GiB,
        "categories_gib": {k: v / GiB for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "sites_gib": {k: v / GiB for k, v in sorted(sites.items(), key=lambda kv: -kv[1])},
        "largest": [{"site": s, "dtype": d, "shape": sh, "count": c, "gib": b / GiB}
                    for (s, d, sh), (c, b) in sorted(tensors.items(), key=lambda kv: -kv[1][1])[:200]],
    }  # fmt: skip


def markdown(result: dict) -> str:
    lines = [f"## Learner memory, {result['tokens']} tokens ({result['episodes']} episodes) x "
             f"{result['micro_batches']} micro-batches, fast paths {result['fast_paths']}, "
             f"checkpoint={result['checkpoint']}", "",
             f"Peak {result['peak_gib']:.2f} GiB (step 2, in {result['peak_phase']}); end of forward "
             f"{result['forward_end']['total_gib']:.2f} GiB.", ""]  # fmt: skip
    for title, snap in (
        ("at the peak", result["at_peak"]),
        ("at the end of the forward", result["forward_end"]),
    ):
        lines += [f"### Live {title}: {snap['total_gib']:.2f} GiB", "", "| category | GiB |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in snap["categories_gib"].items()]
        lines += ["", "| allocated in / where (summed over the layers of a kind) | GiB |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in list(snap["sites_gib"].items())[:30]]
        lines += ["", "| where | dtype | shape | count | GiB |", "|---|---|---|---|---|"]
        lines += [f"| {r['site']} | {r['dtype']} | {r['shape']} | {r['count']} | {r['gib']:.3f} |"
                  for r in snap["largest"][:25]]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def measure(
    arch: dict,
    tokens: int,
    fast_paths: str = "auto",
    checkpoint: str = "none",
    seed: int | None = None,
    micro_batches: int = 1,
) -> dict:
    """Peak and breakdowns of the second train step at ``tokens`` packed tokens a micro-batch (the bench's
    batch), ``micro_batches`` of them per optimizer step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seed = tokens if seed is None else seed
    lengths = episode_lengths(tokens, np.random.default_rng(seed))
    mem = LiveMemory()
    bounds = [[0, *np.cumsum(lengths).tolist()]]
    from model import HybridConfig

    # real host tensors, as the learner gets them
    batch = make_batch(lengths, HybridConfig(**arch), seed=seed)
    with FakeTensorMode(allow_non_fake_inputs=True), mem, cuda_code_paths(bounds):
        learner = build_learner(arch, tokens, fast_paths, checkpoint)
        kinds = {i: ("kda" if l.is_kda else "mla") + ("+moe" if l.is_moe else "+dense")
                 for i, l in enumerate(learner.base_model.model.layers)}  # fmt: skip
        mem.on_snapshot = lambda live: classify(live, learner, kinds)
        with mem.module_sites(learner.base_model):
            train_step(learner, batch, mem, micro_batches)  # creates the AdamW state
            start = mem.events
            mem.reset_peak()
            train_step(learner, batch, mem, micro_batches)
            peak, peak_event, peak_phase = mem.peak, mem.peak_event, mem.peak_phase
            forward_end = mem.forward_end
            mem.snap_event, mem.events = peak_event, start  # step 3 allocates as step 2 did
            train_step(learner, batch, mem, micro_batches)
            if mem.snapshot is None:
                raise RuntimeError("step 3 did not allocate as step 2 did: no snapshot at the peak")
    return {
        "tokens": tokens, "episodes": len(lengths), "lengths": lengths, "fast_paths": fast_paths,
        "checkpoint": checkpoint, "micro_batches": micro_batches, "peak_gib": peak / GiB, "peak_phase": peak_phase,
        "at_peak": mem.snapshot, "forward_end": forward_end,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", type=Path, default=ROOT / "configs/model/gpu_1b.yaml")
    ap.add_argument("--tokens", default="16384", help="micro-batch sizes (comma-separated)")
    ap.add_argument("--fast-paths", default="auto", help="model.fast spec, e.g. moe=loop")
    ap.add_argument("--checkpoint", default="none", choices=["none", "layer", "ffn", "attention"])
    ap.add_argument("--micro-batches", type=int, default=1, help="per optimizer step (gradients accumulated)")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    args = ap.parse_args()
    arch = load_arch(args.preset)
    results = []
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        t0 = time.time()
        results.append(
            measure(arch, tokens, args.fast_paths, args.checkpoint, micro_batches=args.micro_batches)
        )
        print(markdown(results[-1]), flush=True)
        print(f"[{tokens} tokens: {time.time() - t0:.0f} s]", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learner_memory.json").write_text(json.dumps(results, indent=1))
    (args.out / "learner_memory.md").write_text("\n".join(markdown(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
