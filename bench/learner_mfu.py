"""Learner throughput on one GPU: tokens/s, MFU, peak memory and time per component, beside the peer.

One process. For the gpu_1b preset (``configs/model/gpu_1b.yaml``) it builds the project's learner
(``rl.learner.Learner``: bf16 autocast, fp32 master weights, fused AdamW, routing replay on every token)
and times its real train step (forward, PG loss, backward, clip, AdamW) on packed micro-batches of
16K and 64K tokens made of varlen episodes of mixed lengths (log-uniform 128..6144 tokens, prompts
without loss). Before anything is timed it checks one train step on the fast paths against the same
step on the reference paths (``model.fast``): loss, gradient norm and token logprobs within bf16
tolerance (bf16: errors pooled over ``--check-batches`` batches); a failed check stops the run (exit 1).

Reported per micro-batch size: step time, tokens/s, MFU = 6 x active matmul parameters x tokens / step
time / bf16 GEMM peak (the peak is measured in the same run: the best of 5 rounds of 10 8192^3 bf16
matmuls, ``gemm_peak``), peak memory, and the time of each component measured alone at the same shapes on
inputs captured from the step (KDA, MLA, MoE: forward + backward of one layer times the layer count; LM
head + loss; optimizer: clip + AdamW), and the kernel launches / host syncs of one profiled step
(``--profile``). Active matmul parameters = every nn.Linear weight and the router weights, with the routed experts counted top_k /
num_experts times; the embedding lookup is not a matmul and is not counted.

The peer: transformers' ``KimiLinearForCausalLM`` (KDA + MLA + MoE; flash-linear-attention's kernels
when ``fla`` is importable, else transformers' PyTorch fallbacks; experts through transformers'
grouped_mm implementation where the version has it) at matched size (hidden size, layers, layer
pattern, heads, KDA head size, MLA ranks, experts, top-k, shared experts, vocabulary; its experts act
on the hidden size, it has no latent MoE), same bf16 autocast, fused AdamW and token count per step,
as equal-length rows (its best case: no packing). The ratio ours / peer of tokens/s is reported. The
peer runs after all of our sizes, alone on the device: our learner (weights, gradients, optimizer state,
compiled graphs, the allocator's cache) is released first, and its peak memory is its own (``--peer-first``:
before anything of ours is built, so that a call's time limit cannot cut it).

The optimizer component is also split (``optimizer_times``): clip_grad_norm_ alone, AdamW's step alone,
the host's dispatch time of the two, and on a GPU the device's busy time and kernel count of one clip +
step; host dispatch close to the component's time means per-tensor host work (the per-expert
per-expert nn.Linear experts made ~6k parameter tensors before the experts were stacked) and not the device sets it.
``bench/op_counts.py`` counts the aten ops per layer kind on the CPU (no GPU needed).

``--also-fast-paths SPEC[;SPEC...]`` is an A/B within one process (one device call, one host): after each
micro-batch size it times the same learner on the same batch again with each ``SPEC``'s fast paths (e.g.
``glu=recompute``), a row each; each ``SPEC`` passes the same check against the references first.
``--cuda-graphs [blocks|learner]`` (with ``--compile``), after every size's rows: "blocks" (the flag alone) every
compiled block again with inductor's CUDA graphs (``model.compile.compile_regions(cuda_graphs=True)``) on this
fixed batch, each step opened with ``torch.compiler.cudagraph_mark_step_begin()``; "learner" the learner's own
``learner.cuda_graphs`` (every compiled block as graphs on the static layout: each micro-batch padded to a bucket
of ``learner.token_buckets`` and its sequence count to a power of two, the learner opening each micro-batch's
graphs): what a training run gets. Timed per
size as a row "ours, cuda graphs (MODE)" (no components, no profile; an error there is a note, the rows before
it stand).

Results: ``<out>/learner_mfu.json`` (everything) and ``<out>/learner_mfu.md`` (the table), rewritten
after every part. ``--small`` runs the same plumbing on a CPU with a tiny config (fp32).

Device run: the H200 lacks omegaconf (imported by rl.config), einops and fla-core (the peer's kernels);
all three are pure-Python wheels, fetched once into the git-ignored ``.bench-carry/`` with
``pip download --no-deps --dest .bench-carry fla-core==0.6.0 einops omegaconf==2.4.0`` and carried
(``carry: [".bench-carry"]``, 1.4 MB)::

    pip install -q --no-index --no-deps --target /tmp/site .bench-carry/*.whl &&
    PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache \
    python3 bench/learner_mfu.py --out $OUT --tokens 16384 --profile

then ``--tokens 65536`` in a second call (one call is limited to 10 minutes; ``--budget`` stops
starting new parts past it). With ``--compile`` (``learner.compile``, ``model.compile``) each run's row
holds the graphs dynamo compiled per region function and any recompile-limit warning (none expected:
the count depends on the call signatures, not on the layer count or the micro-batch size).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import math
import os
import platform
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL_ARCH = {
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
    "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4},
    "num_attention_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32, "intermediate_size": 128, "first_k_dense_replace": 1,
    "attn_res_block_size": 2,
}  # fmt: skip


@dataclass
class Report:
    env: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    runs: list = field(default_factory=list)
    peer: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "learner_mfu.json").write_text(json.dumps(asdict(self), indent=1, default=str))
        (out / "learner_mfu.md").write_text(markdown(self) + "\n" + memory_markdown(self) + "\n")


# ------------------------------------------------------------------------------------------ setup
def load_arch(path: Path) -> dict:
    import yaml  # not omegaconf: the preset is a flat mapping

    raw = yaml.safe_load(path.read_text())
    return raw["model"] if set(raw) == {"model"} else raw


def episode_lengths(total: int, rng: np.random.Generator, lo: int = 128, hi: int = 6144) -> list[int]:
    """Mixed lengths, log-uniform in [lo, hi], the last one cut so the micro-batch holds exactly ``total``."""
    out, used = [], 0
    while used < total:
        n = round(math.exp(rng.uniform(math.log(lo), math.log(min(hi, total)))))
        n = min(n, total - used)
        out.append(n)
        used += n
    return out


def make_batch(lengths: list[int], config, seed: int = 0):
    """A packed TrainBatch: random tokens, the first ~20% of each episode a prompt (no loss), one
    advantage per episode, rollout logprobs near the policy's, a replayed expert per token and MoE layer."""
    from rl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    seq = torch.repeat_interleave(torch.arange(N), torch.tensor(lengths))
    pos = torch.arange(T) - cu[:-1].long()[seq]
    prompt = torch.tensor([max(1, n // 5) for n in lengths])[seq]
    mask = pos >= prompt
    adv = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)[seq] * mask
    L, E, K = len(config.moe_layer_indices), config.num_experts, config.num_experts_per_token
    routes = torch.rand(T, L, E, generator=g).argsort(-1)[..., :K].to(torch.int32) if L else None  # as rl.batching packs them
    return TrainBatch(
        input_ids_T=torch.randint(0, config.vocab_size, (T,), generator=g),
        cu_seqlens_N1=cu,
        loss_mask_T=mask,
        advantages_T=adv.float(),
        rollout_logprobs_T=torch.where(mask, -math.log(config.vocab_size), 0.0).float(),
        token_weights_T=mask.float() / mask.sum().clamp_min(1),
        seq_ids_T=seq,
        value_mask_T=torch.zeros(T, dtype=torch.bool),
        value_targets_T=torch.zeros(T),
        value_weights_T=torch.zeros(T),
        routed_experts_TLK=routes,
        episode_ids=[f"e{i}" for i in range(N)],
    )


def make_learner(arch: dict, device: str, dtype: str, tokens: int, args, fast_paths: str = "auto"):
    from rl.config import load_config
    from rl.learner import Learner

    cfg = load_config(None, [])
    cfg.model = replace(cfg.model, arch=arch, seed=0)
    cfg.learner = replace(
        cfg.learner, device=device, dtype=dtype, micro_batch_tokens=tokens, torch_threads=torch.get_num_threads(), lr=1e-5,
        fast_paths=fast_paths, activation_checkpointing=args.checkpoint != "none",
        checkpoint_scope=args.checkpoint if args.checkpoint != "none" else "layer", compile=args.compile,
        compile_scope=args.compile_scope,
    )  # fmt: skip
    return Learner(cfg.model, cfg.learner, cfg.algorithm)  # on CUDA its AdamW is fused (rl.learner.fused_adamw)


def matmul_params(model: torch.nn.Module, top_k: int, num_experts: int) -> int:
    """Active matmul parameters: nn.Linear weights, router weights, and the 3-D routed-expert weights (ours,
    ``GroupedExperts``, and the peer's fused experts) at top_k / num_experts. No embedding."""
    from model.moe import MoEGate

    total, routed = 0, 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel()
        elif isinstance(m, MoEGate) or type(m).__name__.endswith(("Router", "Gate")):
            total += m.weight.numel() if isinstance(getattr(m, "weight", None), torch.Tensor) else 0
        elif type(m).__name__.endswith("Experts"):
            routed += sum(p.numel() for p in m.parameters(recurse=False))
    return total + routed * top_k // max(num_experts, 1)


class _RecompileHits(logging.Handler):
    """dynamo's "hit config.recompile_limit" warnings (the function and the last guard that failed)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        if "recompile_limit" in record.getMessage():
            self.messages.append(record.getMessage()[:400])


RECOMPILE_HITS = _RecompileHits()
logging.getLogger("torch._dynamo").addHandler(RECOMPILE_HITS)


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by the first line of their reason (a compiled block that
    breaks runs as several graphs with eager code between them: more host work a step)."""
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = str(reason).strip().splitlines()[0][:160]
        out[key] = out.get(key, 0) + n
    return out


# ------------------------------------------------------------------------------------------ timing
class Clock:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, reps: int = 3, warmup: int = 1) -> float:
        """Median seconds of ``fn()``."""
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return float(np.median(out))


def gemm_peak(clock: Clock, cuda: bool, rounds: int = 5, per_round: int = 10) -> float:
    """The bf16 GEMM rate MFU divides by (fp32 on a CPU): 8,192^3 products timed ``per_round`` back to back, the
    best of ``rounds`` rounds after a warm-up. The median of single products it took before read 715 and 745
    TFLOP/s two minutes apart on one H100 (bench/RESULTS.md, 2026-12-06): the clocks of a burst vary, and a peak
    read low inflates MFU. The best of several rounds is the highest rate the card showed, so MFU errs low."""
    n = 8192 if cuda else 512
    dt = torch.bfloat16 if cuda else torch.float32
    a, b = (torch.randn(n, n, device="cuda" if cuda else "cpu", dtype=dt) for _ in range(2))
    c = torch.empty_like(a)

    def burst() -> None:
        for _ in range(per_round):
            torch.mm(a, b, out=c)

    burst()
    best = min(clock.time(burst, reps=1, warmup=0) for _ in range(rounds))
    return 2 * n**3 * per_round / best


CUDA_GRAPHS = {"on": False}  # --cuda-graphs: the blocks replay as CUDA graphs, each step marks its start


def train_step(learner, batch) -> dict:
    if CUDA_GRAPHS["on"]:
        torch.compiler.cudagraph_mark_step_begin()
    return learner.train_step([[batch]])


def run_cuda_graphs(report: Report, learner, token_sizes: list[int], args, clock, peak: float, cuda: bool, t_start: float):
    """``--cuda-graphs``: the learner's blocks compiled again as CUDA graphs, each size timed once more, for each
    mode named. "blocks": every block, the bench opening each step's graphs; "learner": ``learner.cuda_graphs``
    as a training run sets it (every block on the static layout, the learner opening each micro-batch's graphs)."""
    for mode in args.cuda_graphs:
        run_cuda_graphs_mode(report, learner, token_sizes, args, clock, peak, cuda, t_start, mode)


def run_cuda_graphs_mode(
    report: Report, learner, token_sizes: list[int], args, clock, peak: float, cuda: bool, t_start: float, mode: str
) -> None:
    from model.compile import compile_regions, resolve_compile_scope
    from rl.learner import bucket_tokens

    torch._dynamo.reset()
    scope = resolve_compile_scope(args.compile_scope, learner.device, on_cuda="blocks")
    saved = (learner.cfg, learner.bucket_tokens)
    plain = argparse.Namespace(**{**vars(args), "components": False, "profile": args.profile_graphs,
                                  "profile_syncs": False, "warmup": max(args.warmup, 3)})  # fmt: skip
    try:
        if mode == "learner":
            learner.cfg = dataclasses.replace(learner.cfg, cuda_graphs=True)
            learner.bucket_tokens = bucket_tokens(learner.cfg)
            graphs = learner._graphs(scope, None)
        else:
            graphs, CUDA_GRAPHS["on"] = True, True
        learner.compiled_regions = compile_regions(learner.base_model, scope=scope, cuda_graphs=graphs)
        for tokens in token_sizes:
            if time.time() - t_start > args.budget:
                report.notes.append(f"budget reached before cuda graphs ({mode}) at {tokens} tokens")
                continue
            for variant in (None, *args.also_fast_paths):  # the A/B again, bound by the GPU's own time
                with fast_paths_set(learner, variant):
                    impl = f"ours, cuda graphs ({mode})" + (f", {variant}" if variant else "")
                    run_ours(report, learner, tokens, plain, clock, peak, cuda, impl)
                report.save(args.out)
    except Exception as e:  # an experiment: its failure is reported, the rows before it stand
        report.notes.append(f"cuda graphs ({mode}): {type(e).__name__}: {str(e)[:300]}")
        print(f"[cuda graphs {mode}] failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        report.save(args.out)
        learner.optimizer.zero_grad(set_to_none=True)
        free(cuda)
    finally:
        CUDA_GRAPHS["on"] = False
        learner.cfg, learner.bucket_tokens = saved


def snapshot(learner):
    return {k: v.detach().clone() for k, v in learner.base_model.state_dict().items()}


def restore(learner, snap) -> None:
    learner.base_model.load_state_dict(snap)
    learner.optimizer.state.clear()
    learner.step_count = learner.version = 0


# ------------------------------------------------------------------------------------------ op probe
def probe_ops(report: Report, arch: dict, cuda: bool) -> str:
    """Each fast op alone against its reference at the preset's layer sizes on packed lengths 1, 15, 64,
    65, 300 (and 1600 on a GPU), output and every gradient, in fp32 and under bf16 autocast (GPU). Per op
    the first candidate that runs and agrees is the one the timed learner uses; a failing one is
    reported and skipped, so one broken backend on the device does not cost the whole run."""
    from kernels.testing import error_ratio
    from model import HybridConfig
    from model.fast import use_fast_paths
    from model.layers import GLUMLP, ShortConvolution, seq_layout
    from model.lm_head import chunked_logprobs_entropy, logits_entropy
    from model.mla import GatedMLA
    from model.modeling import token_logprobs
    from model.moe import SparseMoE

    config = HybridConfig(**arch)
    dev = torch.device("cuda" if cuda else "cpu")
    lengths = [1, 15, 64, 65, 300] + ([1600] if cuda else [])
    T, D, V = sum(lengths), config.hidden_size, config.vocab_size
    layout = seq_layout(1, T, torch.tensor([0, *np.cumsum(lengths).tolist()]), dev)
    lac = config.linear_attn_config
    C = int(lac["num_heads"]) * int(lac["head_dim"])
    mla_idx = next(i for i in range(config.num_hidden_layers) if not config.is_kda_layer(i))
    torch.manual_seed(0)
    Z, I = config.routed_expert_hidden_size or D, config.moe_intermediate_size
    mods = {
        "moe": SparseMoE(config), "attention": GatedMLA(config, mla_idx),
        "conv": ShortConvolution(C, int(lac["short_conv_kernel_size"])), "lm_head": torch.nn.Linear(D, V, bias=False),
        "glu": GLUMLP(Z, I, config.hidden_act, (config.activation_situ_beta, config.activation_situ_linear_beta)),
    }  # fmt: skip
    for m in mods.values():
        m.to(dev)
        for p in m.parameters():
            if p.ndim >= 2:
                torch.nn.init.normal_(p, std=0.05)
    widths = {"conv": C, "glu": 2 * I}
    # the GLU sees gate/up pre-activations of every slot: k rows per token, scaled past the betas
    xs = {op: torch.randn(1, T * (config.num_experts_per_token if op == "glu" else 1), widths.get(op, D),
                          device=dev) * (8.0 if op == "glu" else 1.0) for op in mods}  # fmt: skip
    targets = torch.randint(0, V, (1, T), device=dev)
    reference = {"moe": "loop", "attention": "loop", "conv": "torch", "lm_head": "plain", "glu": "torch"}
    candidates = {
        "moe": ["grouped"],
        "attention": ["varlen", "flex"],
        "conv": ["triton"],
        "lm_head": ["chunked"],
        "glu": ["triton", "recompute"] if cuda else ["recompute"],
    }

    def run(op: str, choice: str, half: bool) -> list[torch.Tensor]:
        m, x = mods[op], xs[op].detach().requires_grad_()
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if half else contextlib.nullcontext()
        with use_fast_paths("reference", **{op: choice}), autocast:
            if op == "moe":
                y = m(x)[0]
            elif op == "attention":
                y = m(x, layout, layout.cu_seqlens_N1.long())[0]
            elif op == "conv":
                y = m(x, layout, need_state=False)[0]
            elif op == "glu":
                y = m.glu(*x.chunk(2, dim=-1))
            elif choice == "chunked":
                y = torch.stack(chunked_logprobs_entropy(m, x, targets, with_entropy=True))
            else:
                logits = m(x)
                y = torch.stack([token_logprobs(logits, targets), logits_entropy(logits)])
            g = torch.randn(y.shape, device=dev, generator=torch.Generator(dev).manual_seed(1)).to(y.dtype)
            grads = torch.autograd.grad(y, [x, *m.parameters()], g, allow_unused=True)
        return [y.detach().float()] + [None if t is None else t.float() for t in grads]

    chosen = dict(reference)
    for op in mods:
        refs = {half: run(op, reference[op], half) for half in ((False, True) if cuda else (False,))}
        for cand in candidates[op]:
            ok = True
            for half, ref in refs.items():
                tol = 3e-2 if half else 1e-4
                row = {"kind": "op probe", "op": op, "impl": cand, "dtype": "bfloat16" if half else "float32",
                       "tokens": T, "tolerance": tol}  # fmt: skip
                try:
                    got = run(op, cand, half)
                    errs = [error_ratio(a, b) for a, b in zip(ref, got) if a is not None and b is not None]
                    row.update(max_err_ratio=max(errs), out_err_ratio=errs[0], ok=max(errs) <= tol)
                except Exception as e:  # a backend missing or broken on this device
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                report.checks.append(row)
                ok = ok and row["ok"]
                print(f"[probe] {op}={cand} {row['dtype']}: {'OK' if row['ok'] else 'FAILED'} "
                      f"{row.get('max_err_ratio', row.get('error'))}", flush=True)  # fmt: skip
            if ok:
                chosen[op] = cand
                break
    report.env["fast_paths_used"] = chosen
    return ",".join(f"{k}={v}" for k, v in chosen.items())


# ------------------------------------------------------------------------------------------ check
def _step_results(learner, batch, paths, dtype: str) -> dict:
    """Token logprobs, loss and grad norm of one train step on ``paths`` in ``dtype``; weights restored."""
    from model.fast import FastPaths

    snap, saved = snapshot(learner), (learner.fast_paths, learner.cfg)
    learner.fast_paths = FastPaths.reference() if paths == "reference" else paths
    learner.cfg = replace(learner.cfg, dtype=dtype)
    t0 = time.time()
    try:
        lp = learner.logprobs(batch)
        restore(learner, snap)
        m = train_step(learner, batch)
        # progress: a cold process compiles every Triton autotuner config here (minutes on a GPU)
        print(f"[check] {'reference' if paths == 'reference' else 'fast'} {dtype} step at {batch.num_tokens} "
              f"tokens: {time.time() - t0:.0f} s", flush=True)  # fmt: skip
        return {"loss": m["loss"], "grad_norm": m["grad_norm"], "logprobs": lp}
    finally:
        restore(learner, snap)
        learner.fast_paths, learner.cfg = saved


def _distance(a: dict, b: dict, mask) -> dict:
    d = (a["logprobs"] - b["logprobs"]).abs()[mask]
    return {"loss_abs": abs(a["loss"] - b["loss"]),
            "grad_norm_rel": abs(a["grad_norm"] - b["grad_norm"]) / max(b["grad_norm"], 1e-12),
            "logprob_mean_abs": float(d.mean()), "logprob_max_abs": float(d.max())}  # fmt: skip


def _pooled(distances: list[dict]) -> dict:
    """Distances of several check batches pooled: means, and the largest of the maxima."""
    return {k: (max if k.endswith("max_abs") else np.mean)([d[k] for d in distances]) for k in distances[0]}


def check_fast_vs_reference(report: Report, learner, batches: list, half: bool) -> bool:
    """One train step on the reference paths and one on the fast paths from the same weights, per batch.

    fp32: the fast paths are GEMM-rounding away from the references (absolute tolerances). bf16: two
    bf16 computations of a deep random-init model differ by bf16 rounding compounded over the layers,
    so both are measured against the fp32 reference step, and the fast paths pass when their error is
    at most 1.5x the bf16 reference's own (plus a small floor). The loss and the grad norm are one number
    per step, and the ratio of two draws of the same rounding noise passes 1.5 about a third of the time,
    so in bf16 the errors are pooled over several batches (``--check-batches``): means over the batches
    (the largest maximum for the max)."""
    fast_paths = learner.fast_paths
    ref_errs, fast_errs, rows = [], [], []
    for batch in batches:
        mask = batch.loss_mask_T
        ref = _step_results(learner, batch, "reference", "bfloat16" if half else "float32")
        fast = _step_results(learner, batch, fast_paths, "bfloat16" if half else "float32")
        rows.append({"tokens": batch.num_tokens, "reference": {k: ref[k] for k in ("loss", "grad_norm")},
                     "fast": {k: fast[k] for k in ("loss", "grad_norm")}})  # fmt: skip
        if half:
            truth = _step_results(learner, batch, "reference", "float32")
            ref_errs.append(_distance(ref, truth, mask))
            fast_errs.append(_distance(fast, truth, mask))
            rows[-1]["fast_vs_bf16_reference"] = _distance(fast, ref, mask)
        else:
            fast_errs.append(_distance(fast, ref, mask))
            rows[-1]["loss_tolerance"] = 1e-5 + 1e-4 * abs(ref["loss"])
    row = {"kind": "train step fast vs reference", "fast_paths": str(fast_paths), "dtype": "bfloat16" if half else "float32",
           "tokens": [b.num_tokens for b in batches], "batches": rows,
           "reference": rows[0]["reference"], "fast": rows[0]["fast"]}  # fmt: skip
    got = _pooled(fast_errs)
    if half:
        ref_err = _pooled(ref_errs)
        tol = {k: 1.5 * v + floor for (k, v), floor in zip(ref_err.items(), (1e-4, 1e-3, 1e-3, 1e-2))}
        row.update(vs="float32 reference step", reference_error=ref_err,
                   per_batch={"reference_error": ref_errs, "fast_error": fast_errs})  # fmt: skip
    else:
        tol = {"loss_abs": min(r["loss_tolerance"] for r in rows), "grad_norm_rel": 1e-3, "logprob_mean_abs": 1e-4}
    ok = all(got[k] <= v for k, v in tol.items())
    row.update(ok=ok, measured=got, tolerance=tol)
    report.checks.append(row)
    print(f"[check] {fast_paths} {row['dtype']} {'OK' if ok else 'FAILED'} {json.dumps(got)} tolerance {json.dumps(tol)} "
          f"ref {row['reference']} fast {row['fast']}", flush=True)  # fmt: skip
    return ok


# ------------------------------------------------------------------------------------------ components
def capture_inputs(learner, batch) -> dict:
    """Inputs of the first KDA, MLA and MoE layer and of the LM head, from one no-grad forward."""
    from model.capture import first_calls
    from model.kda import KimiDeltaAttention
    from model.mla import GatedMLA
    from model.moe import SparseMoE

    model = learner.base_model
    kinds = {KimiDeltaAttention: "kda", GatedMLA: "mla", SparseMoE: "moe"}
    head = {}
    # the decoder stack's output: the final normed hidden states (the last mix and the norm may run as one)
    hook = model.model.register_forward_hook(lambda mod, a, out: head.__setitem__("head", out[0]))
    try:
        with first_calls(model, kinds) as seen, torch.no_grad():
            learner.forward(batch)
    finally:
        hook.remove()
    return {**seen, **head}


def _leaf(x):
    return x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x


def component_times(learner, batch, clock: Clock, counts: dict) -> dict:
    from model.fast import pick
    from model.lm_head import chunked_logprobs_entropy, logits_entropy

    cap = capture_inputs(learner, batch)
    out = {}
    for kind in ("kda", "mla", "moe"):
        if cap.get(kind) is None:
            continue
        mod, args, kwargs = cap[kind]
        args = tuple(_leaf(a) for a in args)

        def run(mod=mod, args=args, kwargs=kwargs):
            with learner._paths(), learner._autocast():
                y = mod(*args, **kwargs)[0]
            with learner._paths():
                y.backward(torch.ones_like(y))

        per_layer = clock.time(run)
        out[kind] = {"per_layer_s": per_layer, "layers": counts[kind], "s": per_layer * counts[kind]}
    h = _leaf(cap["head"])
    targets = batch.input_ids_T.to(h.device).roll(-1)[None]
    model = learner.base_model
    head = model.lm_head
    fns = (model.head_stats_fn, model.head_grad_fn)  # the step's per-chunk math: compiled under learner.compile

    def run_head():
        with learner._paths(), learner._autocast():
            if pick("lm_head", h.device) == "chunked":
                lp, ent = chunked_logprobs_entropy(head, h, targets, with_entropy=True, fns=fns)
            else:
                logits = head(h)
                lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
                ent = logits_entropy(logits).detach()
        (lp.sum() + 0.01 * ent.sum()).backward()

    out["lm_head_loss"] = {"s": clock.time(run_head)}
    out["optimizer"] = optimizer_times(learner, clock)  # grads are those of the last step
    return out


def optimizer_times(learner, clock: Clock) -> dict:
    """The learner's clip + AdamW step (``s``, what the table shows), and apart: clip_grad_norm_ alone,
    the optimizer step alone, the host's dispatch time of clip + step (until the calls return, before
    the device finishes: close to ``s`` means the host's per-tensor Python work, not the device, sets the
    time) and, on a GPU, the device's busy time and kernel count of one clip + step (profiler). Optimizer
    state exists already (the timed steps ran), so no first-step state allocation is in these clocks."""
    params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    grads = [p for p in params if p.grad is not None]
    clip = learner.cfg.grad_clip
    out = {"s": clock.time(learner._clip_and_step), "param_tensors": len(params), "with_grad": len(grads),
           "param_numel": sum(p.numel() for p in params),
           "clip_s": clock.time(lambda: torch.nn.utils.clip_grad_norm_(params, clip)),
           "adamw_s": clock.time(learner.optimizer.step)}  # fmt: skip
    host = []
    for _ in range(3):
        clock.sync()
        t0 = time.perf_counter()
        learner._clip_and_step()
        host.append(time.perf_counter() - t0)
        clock.sync()
    out["host_dispatch_s"] = float(np.median(host))
    try:  # the foreach norm is what clip takes on the device; a fallback to one norm per tensor shows here
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        out["clip_foreach"] = True
    except RuntimeError as e:
        out["clip_foreach"] = f"no: {str(e)[:200]}"
    if clock.cuda:
        act = torch.profiler.ProfilerActivity
        clock.sync()
        with torch.profiler.profile(activities=[act.CPU, act.CUDA]) as prof:
            learner._clip_and_step()
            clock.sync()
        kernels = [ev for ev in prof.key_averages() if getattr(ev, "self_device_time_total", 0) > 0]
        out["device_busy_s"] = sum(ev.self_device_time_total for ev in kernels) / 1e6
        out["kernels"] = sum(ev.count for ev in kernels)
        out["top_kernels_ms"] = sorted(((ev.key[:60], ev.self_device_time_total / 1e3, ev.count) for ev in kernels),
                                       key=lambda r: -r[1])[:6]  # fmt: skip
        out["top_host_ms"] = sorted(((ev.key[:60], ev.self_cpu_time_total / 1e3, ev.count) for ev in prof.key_averages()),
                                    key=lambda r: -r[1])[:8]  # fmt: skip
    return out


def profile_step(learner, batch, cuda: bool, table: Path | None = None, syncs: bool = True) -> dict:
    """Kernel launches and GPU time of one step; host syncs counted by CUDA's sync debug mode (``syncs``; not
    for a step replayed from CUDA graphs, whose syncs are the replays'). ``table``: the profiler's op tables
    (by host time and by device time) written there."""
    act = torch.profiler.ProfilerActivity
    acts = [act.CPU] + ([act.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        train_step(learner, batch)
        if cuda:
            torch.cuda.synchronize()
    rows, launches, graph_calls = [], 0, {"forward": 0, "backward": 0}
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0) if cuda else 0
        if cuda and dev_us > 0:
            rows.append((ev.key[:70], dev_us / 1e3, ev.count))
            launches += ev.count
        # AOTAutograd's nodes: one a compiled-graph call with gradient, each way (the host cost per call)
        if ev.key in ("CompiledFunction", "CompiledFunctionBackward"):
            graph_calls["backward" if ev.key.endswith("Backward") else "forward"] += ev.count
    rows.sort(key=lambda r: -r[1])
    busy = device_busy(prof) if cuda else {}
    if table is not None:
        avg = prof.key_averages()
        by = ["self_cpu_time_total"] + (["self_device_time_total"] if cuda else [])
        table.write_text("\n\n".join(avg.table(sort_by=k, row_limit=60, max_name_column_width=70) for k in by))
    n_syncs = syncs_fwd_bwd = None
    if cuda and syncs:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(learner, batch)
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("default")
        n_syncs = sum("synchroniz" in str(w.message) for w in caught)
        syncs_fwd_bwd = count_fwd_bwd_syncs(learner, batch)
    return {"kernels_per_step": launches, "host_syncs_per_step": n_syncs, "host_syncs_fwd_bwd": syncs_fwd_bwd,
            "compiled_graph_calls": graph_calls, "top_kernels_ms": rows[:15], **busy}  # fmt: skip


def device_busy(prof, kind=torch.autograd.DeviceType.CUDA) -> dict:
    """How much of the profiled step the GPU spent running kernels: the union of the kernels' intervals
    against the span from the first launch to the last kernel's end. A busy fraction well under 1 means
    the host does not launch work fast enough (the step is host-bound); near 1, the kernels themselves
    are the time. Also the kernel count (device events, not the ops that launched them)."""
    named = sorted(
        (ev.time_range.start, ev.time_range.end, ev.name)
        for ev in prof.events()
        if ev.device_type == kind and ev.time_range.end > ev.time_range.start
    )
    if not named:
        return {}
    spans = [(a, b) for a, b, _ in named]
    busy = sum(b - a for a, b in _union(spans))
    host_events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CPU]
    span = spans[-1][1] - min([spans[0][0], *(ev.time_range.start for ev in host_events)])
    host = [(ev.time_range.start, ev.time_range.end, ev.name, _root(ev).name) for ev in host_events]
    return {"device_kernels": len(spans), "device_busy_ms": busy / 1e3, "device_span_ms": span / 1e3,
            "device_busy_frac": busy / span if span > 0 else None,
            "device_idle": device_idle(spans, host, names=[n for *_, n in named])}  # fmt: skip


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals sorted by start, as disjoint intervals in order."""
    out = [spans[0]]
    for a, b in spans[1:]:
        if a > out[-1][1]:
            out.append((a, b))
        elif b > out[-1][1]:
            out[-1] = (out[-1][0], b)
    return out


def _root(ev):
    """The outermost host op around a profiler event."""
    while ev.cpu_parent is not None:
        ev = ev.cpu_parent
    return ev


RUNTIME_CALLS = ("cu", "Activity Buffer")
"""Name prefixes of host events that are CUDA runtime or driver calls (cuda*, cu*: launches, copies, syncs), not
the op that made them."""


def device_idle(
    spans: list[tuple[float, float]], host: list[tuple[float, float, str, str]], min_gap_us: float = 20.0, top: int = 8,
    names: list[str] | None = None,
) -> dict:
    """Where the GPU waited within a profiled step: its idle time between kernels (gaps of at least ``min_gap_us``,
    and the wait before the first kernel, from the first host event), each gap charged to the host op that was
    running when it ended (the innermost one that is not a runtime call: what the host was doing while the GPU had
    nothing queued). ``spans``: the kernels' (start, end) in us, sorted by start; ``host``: (start, end, name, the
    name of its outermost op) of every host event; ``names``: the kernels' names, in ``spans``' order. Returns the
    wait before the first kernel, the idle time in gaps and their count, the ``top`` host ops by idle time charged
    to them (ms, gaps, outermost op), and the ``top`` longest gaps, each with where it starts (ms from the first
    host event), the host ops running as it began and as it ended (innermost / outermost), and the kernels around
    it when ``names`` are given: where in the step each one sits."""
    gaps = [(b0, a1) for (_, b0), (a1, _) in itertools.pairwise(_union(spans)) if a1 - b0 >= min_gap_us]
    ops = sorted((h for h in host if not h[2].startswith(RUNTIME_CALLS)), key=lambda h: (h[0], -h[1]))  # outer first
    starts = [h[0] for h in ops]

    def running(t: float) -> tuple[str, str]:  # the latest-starting op that still runs at t is the innermost one
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and ops[i][1] < t:
            i -= 1
        return ops[i][2:] if i >= 0 else ("(no host op)", "")

    by_op: dict[tuple[str, str], list[float]] = {}
    for g0, g1 in gaps:
        acc = by_op.setdefault(running(g1), [0.0, 0])
        acc[0], acc[1] = acc[0] + (g1 - g0), acc[1] + 1
    first_host = min((h[0] for h in host), default=spans[0][0])
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    kernel_starts = [a for a, _ in spans]

    def gap_row(g0: float, g1: float) -> dict:
        row = {"at_ms": (g0 - first_host) / 1e3, "ms": (g1 - g0) / 1e3,
               "began_in": " / ".join(running(g0)), "ended_in": " / ".join(running(g1))}  # fmt: skip
        if names is not None:
            i = bisect.bisect_left(kernel_starts, g1)
            row["after_kernel"] = names[i - 1][:60] if i else ""
            row["before_kernel"] = names[i][:60] if i < len(names) else ""
        return row
    return {"before_first_kernel_ms": max(0.0, spans[0][0] - first_host) / 1e3,
            "in_gaps_ms": sum(g1 - g0 for g0, g1 in gaps) / 1e3, "gaps": len(gaps),
            "by_host_op": [{"op": name, "outermost": root, "ms": us / 1e3, "gaps": n}
                           for (name, root), (us, n) in ranked],
            "longest": [gap_row(g0, g1) for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:top]]}  # fmt: skip


def idle_line(idle: dict) -> str:
    """``device_idle`` as report lines: the totals and host ops, then the longest gaps."""
    ops = "; ".join(f"{o['op']} ({o['outermost']}) {o['ms']:.1f} ms in {o['gaps']}" for o in idle["by_host_op"])

    def around(g: dict) -> str:
        return f"; after {g['after_kernel']}, before {g['before_kernel']}" if "after_kernel" in g else ""

    gaps = "; ".join(f"{g['ms']:.2f} ms at {g['at_ms']:.1f} ms ({g['began_in']} -> {g['ended_in']}{around(g)})"
                     for g in idle.get("longest", []))  # fmt: skip
    return (f"GPU idle: {idle['before_first_kernel_ms']:.1f} ms before the first kernel, {idle['in_gaps_ms']:.1f} ms "
            f"in {idle['gaps']} gaps; by the host op running as a gap ended: {ops}"
            + (f"\nlongest gaps (host op as it began -> as it ended): {gaps}" if gaps else ""))  # fmt: skip


def count_fwd_bwd_syncs(learner, batch) -> dict:
    """Host syncs of the model's forward + loss + backward alone (not the learner's metrics, clip and
    optimizer), with where each comes from (the first frame inside the repository). The loss is the learner's
    own ``policy_loss_stats``: its metrics stay on the device until after the optimizer step."""
    from rl.losses import policy_loss_stats

    learner.policy.train()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fwd = learner.forward(batch, need_entropy=True)
            loss, _ = policy_loss_stats(learner._loss_inputs(batch, fwd, fwd.logprobs_T.detach(), None), learner.algo)
            with learner._paths():
                loss.backward()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    learner.optimizer.zero_grad(set_to_none=True)
    where: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return {"count": sum(where.values()), "where": where}


# ------------------------------------------------------------------------------------------ memory
class SavedTensorLedger:
    """Bytes autograd keeps for backward during a forward, per module path (the innermost module
    running when the tensor is saved), with the dtype and shape of what is saved.

    Each storage is counted once, at its first save (one tensor saved by several ops, or views of
    one buffer, cost their memory once); parameters and their views are not activations and are
    skipped; everything else is counted, autocast's bf16 weight casts and the grouped path's stacked
    expert weights included (``fit`` separates them: they do not grow with the tokens). A
    checkpointed region saves through its own hooks (the innermost hooks win), so what it keeps
    shows up only as its inputs, held by the caller. Tensors a custom autograd Function keeps on
    ``ctx`` attributes instead of ``save_for_backward`` are invisible here: on a GPU the bench
    compares the ledger with the allocator's own count."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.names = {m: n for n, m in model.named_modules()}
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.stack: list[str] = ["(outside)"]
        self.seen: set[int] = set()
        self.keep: list[torch.Tensor] = []  # holds what was counted so storages are not reused mid-forward
        self.rows: dict[tuple[str, str, str], list[int]] = {}  # (module, dtype, shape) -> [count, bytes]

    def _pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (wrapper subclasses)
            return t
        if ptr in self.params or ptr in self.seen or nbytes == 0:
            return t
        self.seen.add(ptr)
        self.keep.append(t)
        key = (self.stack[-1], str(t.dtype).replace("torch.", ""), "x".join(map(str, t.shape)))
        row = self.rows.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += nbytes
        return t

    @contextlib.contextmanager
    def record(self):
        def pre(mod, args):
            self.stack.append(self.names.get(mod, type(mod).__name__))

        def post(mod, args, out):
            self.stack.pop()

        hooks = []
        for m in self.model.modules():
            hooks.append(m.register_forward_pre_hook(pre))
            hooks.append(m.register_forward_hook(post))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in hooks:
                h.remove()
            self.keep.clear()

    def total(self) -> int:
        return sum(b for _, b in self.rows.values())


@contextlib.contextmanager
def _cpu_kda_core_fp32(ledger: SavedTensorLedger):
    """CPU under bf16 autocast: the chunked KDA core in fp32 outside autocast (its triangular solve has
    no bf16 CPU kernel), its saves booked as ``self_attn.kda_core``: those are the CPU path's, not the
    Triton kernel's (which a GPU ledger counts)."""
    import kernels.kda as kda_mod

    real = kda_mod.chunk_kda

    def core(q, k, v, g, beta, **kw):
        ledger.stack.append(ledger.stack[-1] + ".kda_core")
        try:
            with torch.autocast("cpu", enabled=False):
                o, final = real(*(t.float() for t in (q, k, v, g, beta)), **kw)
            return o.to(v.dtype), final
        finally:
            ledger.stack.pop()

    kda_mod.chunk_kda = core
    try:
        yield
    finally:
        kda_mod.chunk_kda = real


def _site(module_path: str, kinds: dict[int, str]) -> tuple[str, str]:
    """("model.layers.5.block_sparse_moe.gate", {5: "kda+moe"}) -> ("kda+moe layer", "block_sparse_moe.gate")."""
    parts = module_path.split(".")
    if len(parts) >= 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return f"{kinds[int(parts[2])]} layer", ".".join(parts[3:]) or "(layer)"
    return "outside layers", module_path


def memory_ledger(learner, batch, cpu_bf16: bool = True) -> dict:
    """One training forward + loss of ``batch`` under a SavedTensorLedger; the graph is dropped, not
    run backward. Returns bytes per (layer kind, sub-module) summed over the layers of that kind,
    per layer kind, the largest saved tensors, and (CUDA) the allocator's growth over the forward."""
    from rl.losses import policy_loss

    model = learner.base_model
    layers = model.model.layers
    kinds = {i: ("kda" if l.is_kda else "mla") + ("+moe" if l.is_moe else "+dense") for i, l in enumerate(layers)}
    ledger = SavedTensorLedger(model)
    cuda = learner.device.type == "cuda"
    learner.policy.train()
    if cuda:
        torch.cuda.synchronize()
        free(True)
        before = torch.cuda.memory_allocated()
    # the CPU learner computes in fp32; autocast there gives the bf16 layout the GPU learner saves
    cpu_half = not cuda and cpu_bf16
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if cpu_half else contextlib.nullcontext()
    with ledger.record(), autocast, _cpu_kda_core_fp32(ledger) if cpu_half else contextlib.nullcontext():
        fwd = learner.forward(batch, need_entropy=True)
        old = fwd.logprobs_T.detach()
        _loss, _ = policy_loss(learner._loss_inputs(batch, fwd, old, None), learner.algo)
    allocated = torch.cuda.memory_allocated() - before if cuda else None
    fwd = old = None
    sites: dict[tuple[str, str], int] = {}
    tensors = []
    for (path, dtype, shape), (count, nbytes) in ledger.rows.items():
        site = _site(path, kinds)
        sites[site] = sites.get(site, 0) + nbytes
        tensors.append({"where": " / ".join(site), "dtype": dtype, "shape": shape, "count": count, "bytes": nbytes})
    merged: dict[tuple[str, str, str], dict] = {}
    for t in tensors:  # the same tensor kind in every layer of a kind: one row
        key = (t["where"], t["dtype"], t["shape"])
        row = merged.setdefault(key, {**t, "count": 0, "bytes": 0})
        row["count"] += t["count"]
        row["bytes"] += t["bytes"]
    layer_counts = {}
    for k in kinds.values():
        layer_counts[f"{k} layer"] = layer_counts.get(f"{k} layer", 0) + 1
    per_kind: dict[str, int] = {}
    for (kind, _), b in sites.items():
        per_kind[kind] = per_kind.get(kind, 0) + b
    return {
        "tokens": batch.num_tokens, "saved_bytes": ledger.total(), "allocated_growth_bytes": allocated,
        "layers_of_kind": layer_counts, "per_kind_bytes": per_kind,
        "per_site_bytes": {" / ".join(k): v for k, v in sorted(sites.items(), key=lambda kv: -kv[1])},
        "largest": sorted(merged.values(), key=lambda r: -r["bytes"])[:40],
    }  # fmt: skip


def fit_per_token(small: dict, large: dict, target: int) -> dict:
    """bytes = a + b * tokens per site from two ledgers of the same layout at two sizes; the value at
    ``target`` tokens. ``a`` holds what does not grow with the tokens (weight casts, stacked experts)."""
    dt = large["tokens"] - small["tokens"]
    out = {}
    for key in large["per_site_bytes"]:
        b0, b1 = small["per_site_bytes"].get(key, 0), large["per_site_bytes"][key]
        per_token = (b1 - b0) / dt
        const = b1 - per_token * large["tokens"]
        out[key] = {"const_bytes": const, "bytes_per_token": per_token, "at_target_bytes": const + per_token * target}
    return out


@contextlib.contextmanager
def checkpoint_scope(model, scope: str):
    """The learner's selective checkpointing (``rl.learner._checkpoint_layers``) on for the block, then
    the layers' own methods back."""
    from rl.learner import CHECKPOINT_SCOPES, _checkpoint_layers

    layers = model.model.layers
    names = CHECKPOINT_SCOPES.get(scope, ())
    if any(n in vars(layer) for layer in layers for n in ("attention", "ffn")):
        raise ValueError("the learner was built with checkpointing on: run --memory-breakdown with --checkpoint none")
    if scope != "none":
        _checkpoint_layers(model, scope)
    try:
        yield
    finally:
        for layer in layers:
            for n in names:
                vars(layer).pop(n, None)


def run_memory_breakdown(report: Report, learner, args, cuda: bool) -> None:
    """Per checkpoint mode and micro-batch size: saved-for-backward bytes per layer kind and
    sub-module (two sizes fitted as a + b x tokens and extrapolated to --memory-target), and on a GPU
    the step's real peak memory and time. Episodes of one length, so attention cost per token is the
    same at both sizes."""
    config = learner.base_model.config
    sizes = [int(t) for t in args.memory_tokens.split(",")]
    for scope in args.memory_modes.split(","):
        for tokens in sizes:
            ep = min(args.memory_episode, tokens)
            lengths = [ep] * (tokens // ep) + ([tokens % ep] if tokens % ep else [])
            batch = make_batch(lengths, config, seed=3)
            row = {"kind": "memory", "checkpoint": scope, "tokens": tokens, "episode_len": ep}
            saved_paths = learner.fast_paths
            if scope == "none-autograd":  # the element-wise regions by plain autograd, as before recompute
                learner.fast_paths = replace(learner.fast_paths, glu="torch", attn_res="torch", norm="torch")
            try:
                with checkpoint_scope(learner.base_model, "none" if scope == "none-autograd" else scope):
                    row["ledger"] = memory_ledger(learner, batch, args.memory_cpu_bf16)
                    if cuda:
                        free(True)
                        torch.cuda.reset_peak_memory_stats()
                        t0 = time.perf_counter()
                        train_step(learner, batch)
                        torch.cuda.synchronize()
                        row.update(step_s=time.perf_counter() - t0,
                                   peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)  # fmt: skip
            except torch.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e)[:160]}"
            finally:
                learner.fast_paths = saved_paths
            learner.optimizer.zero_grad(set_to_none=True)
            batch = None
            free(cuda)
            report.memory.append(row)
            report.save(args.out)
            print(f"[memory] checkpoint={scope} {tokens} tokens: {_memory_line(row)}", flush=True)
        done = [r for r in report.memory if r["checkpoint"] == scope and "ledger" in r]
        if len(done) >= 2:
            fit = fit_per_token(done[-2]["ledger"], done[-1]["ledger"], args.memory_target)
            report.memory.append({"kind": "memory fit", "checkpoint": scope, "target_tokens": args.memory_target,
                                  "from_tokens": [done[-2]["tokens"], done[-1]["tokens"]], "sites": fit,
                                  "total_at_target_gib": sum(v["at_target_bytes"] for v in fit.values()) / 2**30})  # fmt: skip
            print(f"[memory] checkpoint={scope}: saved at {args.memory_target} tokens "
                  f"{report.memory[-1]['total_at_target_gib']:.1f} GiB (fit)", flush=True)  # fmt: skip
        report.save(args.out)


def _memory_line(row: dict) -> str:
    led = row.get("ledger", {})
    parts = [f"saved {led.get('saved_bytes', 0) / 2**30:.2f} GiB"]
    if led.get("allocated_growth_bytes") is not None:
        parts.append(f"allocator +{led['allocated_growth_bytes'] / 2**30:.2f} GiB over the forward")
    if "peak_mem_gib" in row:
        parts.append(f"step {row['step_s'] * 1e3:.0f} ms, peak {row['peak_mem_gib']:.1f} GiB")
    return ", ".join(parts + ([row["error"]] if "error" in row else []))


def memory_markdown(report: Report) -> str:
    lines = []
    for fit in (r for r in report.memory if r["kind"] == "memory fit"):
        lines += [f"\nSaved for backward at {fit['target_tokens']} tokens, checkpoint={fit['checkpoint']} "
                  f"(fit from {fit['from_tokens']}): {fit['total_at_target_gib']:.2f} GiB", "",
                  "| where | GiB at target | MiB per 1K tokens | constant MiB |", "|---|---|---|---|"]  # fmt: skip
        for key, v in sorted(fit["sites"].items(), key=lambda kv: -kv[1]["at_target_bytes"])[:25]:
            lines.append(f"| {key} | {v['at_target_bytes'] / 2**30:.2f} | {v['bytes_per_token'] * 1024 / 2**20:.1f} | "
                         f"{v['const_bytes'] / 2**20:.0f} |")  # fmt: skip
    steps = [r for r in report.memory if r["kind"] == "memory" and ("peak_mem_gib" in r or "error" in r)]
    if steps:
        lines += ["", "| checkpoint | tokens | step | peak memory | saved (ledger) | allocator growth |", "|---|---|---|---|---|---|"]
        for r in steps:
            led = r.get("ledger", {})
            grow = led.get("allocated_growth_bytes")
            lines.append(f"| {r['checkpoint']} | {r['tokens']} | {r.get('step_s', 0) * 1e3:.0f} ms | "
                         f"{r.get('peak_mem_gib', float('nan')):.1f} GiB | {led.get('saved_bytes', 0) / 2**30:.2f} GiB | "
                         f"{'-' if grow is None else f'{grow / 2**30:.2f} GiB'} | {r.get('error', '')}")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ runs
@contextlib.contextmanager
def fast_paths_set(learner, spec: str | None):
    """The learner on ``spec``'s fast paths inside the block (None: as it is)."""
    from model.fast import FastPaths

    saved = learner.fast_paths
    if spec is not None:
        learner.fast_paths = FastPaths.parse(spec)
    try:
        yield
    finally:
        learner.fast_paths = saved


def run_ours(
    report: Report, learner, tokens: int, args, clock: Clock, peak: float, cuda: bool, impl: str = "ours"
) -> None:
    config = learner.base_model.config
    lengths = episode_lengths(tokens, np.random.default_rng(tokens))
    batch = make_batch(lengths, config, seed=tokens)
    n_mm = matmul_params(learner.base_model, config.num_experts_per_token, config.num_experts)
    t0 = time.time()
    for _ in range(args.warmup):  # compilation, autotuning, allocator warm-up
        train_step(learner, batch)
    warm_s = time.time() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step_s = clock.time(lambda: train_step(learner, batch), reps=args.steps, warmup=0)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    layers = learner.base_model.model.layers
    counts = {"kda": sum(layer.is_kda for layer in layers), "mla": sum(not layer.is_kda for layer in layers),
              "moe": sum(layer.is_moe for layer in layers)}  # fmt: skip
    comps = component_times(learner, batch, clock, counts) if args.components else {}
    prof = {}
    if args.profile:  # one table file per row: profile_16384.txt, profile_16384_cuda_graphs_learner.txt, ...
        slug = re.sub(r"[^a-z0-9]+", "_", impl.removeprefix("ours").lower()).strip("_")
        table = args.out / f"profile_{tokens}{'_' + slug if slug else ''}.txt"
        prof = profile_step(learner, batch, cuda, table, syncs=getattr(args, "profile_syncs", True))
    row = {
        "impl": impl, "tokens": tokens, "episodes": len(lengths), "lengths_min_max": [min(lengths), max(lengths)],
        "step_s": step_s, "tokens_per_s": tokens / step_s, "mfu": 6 * n_mm * tokens / step_s / peak,
        "active_matmul_params": n_mm, "peak_mem_gib": peak_gib, "warmup_s": warm_s, "components": comps,
        "checkpoint": args.checkpoint, "compile": args.compile and args.compile_scope, "fast_paths": str(learner.fast_paths), **prof,
    }  # fmt: skip
    if learner.compiled_regions:  # one graph per call signature; a limit hit would leave variants eager
        row["compiled_regions"] = {r.name: {"graphs": r.graphs(), "failed": r.failed} for r in learner.compiled_regions}
        row["recompile_limit_hits"] = list(RECOMPILE_HITS.messages)
        row["graph_breaks"] = graph_breaks()
        print(f"[compile] {row['compiled_regions']}; recompile limit hits: {len(RECOMPILE_HITS.messages)}; "
              f"graph breaks: {row['graph_breaks'] or 'none'}", flush=True)  # fmt: skip
    report.runs.append(row)
    print(f"[{impl}] {tokens} tokens ({len(lengths)} episodes): {step_s * 1e3:.0f} ms/step, "
          f"{row['tokens_per_s']:.0f} tok/s, MFU {row['mfu'] * 100:.1f}%, peak "
          f"{peak_gib if peak_gib is None else round(peak_gib, 1)} GiB, components "
          f"{ {k: round(v['s'] * 1e3, 1) for k, v in comps.items()} } ms", flush=True)  # fmt: skip
    batch = None  # frees it (the timing closure holds the same cell) before the next part
    learner.optimizer.zero_grad(set_to_none=True)
    free(cuda)


def peer_config(arch: dict):
    """transformers' KimiLinearConfig at Kimi Linear's matched size (``model.export.kimi_linear_matched``,
    the peer of bench/rollout_throughput.py too)."""
    from model import HybridConfig
    from model.export import kimi_linear_matched, transformers_config

    return transformers_config(kimi_linear_matched(HybridConfig(**arch)))


def run_peer(report: Report, arch: dict, tokens: int, args, clock: Clock, peak: float, cuda: bool) -> None:
    try:
        from transformers.models.kimi_linear import KimiLinearForCausalLM

        config = peer_config(arch)
    except Exception as e:  # an older transformers without the model, or a changed config
        report.peer.append({"tokens": tokens, "error": f"{type(e).__name__}: {e}"})
        print(f"[peer] not measured: {type(e).__name__}: {e}", flush=True)
        return
    try:
        import fla  # noqa: F401

        kernels = "fla"
    except ImportError:
        kernels = "torch fallbacks (fla not importable)"
    dev = torch.device("cuda" if cuda else "cpu")
    model = None
    for impl in ("grouped_mm", None):  # transformers' grouped experts where this version has them
        try:
            if impl:
                config._experts_implementation = impl
            config._attn_implementation = "sdpa"
            torch.manual_seed(0)
            model = KimiLinearForCausalLM(config).to(dev).train()
            break
        except Exception as e:
            report.notes.append(f"peer experts_implementation={impl}: {type(e).__name__}: {e}")
    if model is None:
        report.peer.append({"tokens": tokens, "error": "could not build the peer (see notes)"})
        return
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=cuda)
    rows = max(1, tokens // args.peer_row)
    ids = torch.randint(0, config.vocab_size, (rows, tokens // rows), device=dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    resident = torch.cuda.memory_allocated() if cuda else 0  # the peer's weights and batch
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # from before its first step: optimizer state included
        for _ in range(args.warmup):
            step()
        step_s = clock.time(step, reps=args.steps, warmup=0)
    except Exception as e:
        report.peer.append({"tokens": tokens, "error": f"{type(e).__name__}: {e}", "kernels": kernels})
        print(f"[peer] failed: {type(e).__name__}: {e}", flush=True)
        model = opt = None
        free(cuda)
        return
    n_mm = matmul_params(model, config.num_experts_per_token, config.num_experts)
    row = {"impl": "KimiLinearForCausalLM", "tokens": rows * (tokens // rows), "rows": rows, "kernels": kernels,
           "experts_implementation": getattr(model.config, "_experts_implementation", None), "step_s": step_s,
           "tokens_per_s": rows * (tokens // rows) / step_s, "active_matmul_params": n_mm,
           "mfu": 6 * n_mm * rows * (tokens // rows) / step_s / peak,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "weights_and_batch_gib": resident / 2**30 if cuda else None}  # fmt: skip
    report.peer.append(row)
    print(f"[peer] {row['tokens']} tokens as {rows} rows ({kernels}): {step_s * 1e3:.0f} ms/step, "
          f"{row['tokens_per_s']:.0f} tok/s, MFU {row['mfu'] * 100:.1f}%", flush=True)  # fmt: skip
    model = opt = None
    free(cuda)


def run_peers(report: Report, arch: dict, token_sizes: list[int], args, clock: Clock, peak: float, cuda: bool,
              t_start: float) -> None:
    for tokens in token_sizes:
        if time.time() - t_start > args.budget:
            report.notes.append(f"budget reached before peer at {tokens} tokens")
            continue
        try:
            run_peer(report, arch, tokens, args, clock, peak, cuda)
        except torch.OutOfMemoryError as e:
            report.notes.append(f"peer at {tokens} tokens: out of memory")
            print(f"[oom] peer {tokens}: {str(e)[:200]}", flush=True)
            free(cuda)
        report.save(args.out)


def release_learner(learner, cuda: bool) -> float | None:
    """Drop our learner's device memory before the peer runs: gradients, optimizer state, the parameters'
    storage (so that a reference left anywhere holds no memory), the reference model, compiled graphs and
    the allocator's cache. Returns the GiB still allocated afterwards (the peer's baseline)."""
    learner.optimizer.zero_grad(set_to_none=True)
    learner.optimizer.state.clear()
    models = [m for m in (learner.policy, learner.base_model, learner.reference, learner.value_head) if m is not None]
    for m in models:
        for t in [*m.parameters(), *m.buffers()]:
            t.grad = None
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    learner.optimizer = learner.policy = learner.base_model = learner.reference = learner.value_head = None
    torch._dynamo.reset()
    free(cuda)
    return torch.cuda.memory_allocated() / 2**30 if cuda else None


def free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ output
def markdown(report: Report) -> str:
    lines = [
        "| micro-batch tokens | impl | step | tokens/s | MFU | peak memory | KDA | MLA | MoE | LM head + loss | "
        "optimizer | kernels / syncs per step | ours / peer tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    peers = {p["tokens"]: p for p in report.peer if "error" not in p}
    for r in report.runs:
        c = r.get("components", {})
        ms = lambda k: f"{c[k]['s'] * 1e3:.0f} ms" if k in c else "-"  # noqa: B023 (used at once)
        peer = peers.get(r["tokens"])
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-"
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else "-"
        fb = (r.get("host_syncs_fwd_bwd") or {}).get("count")
        ks = f"{r.get('kernels_per_step', '-')} / {r.get('host_syncs_per_step', '-')}"
        ks += f" ({fb} in fwd+bwd)" if fb is not None else ""
        lines.append(f"| {r['tokens']} | {r.get('impl', 'ours')} | {r['step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:.0f} | "
                     f"{r['mfu'] * 100:.1f}% | {mem} | {ms('kda')} | {ms('mla')} | {ms('moe')} | "
                     f"{ms('lm_head_loss')} | {ms('optimizer')} | {ks} | {ratio} |")  # fmt: skip
    for p in report.peer:
        if "error" in p:
            lines.append(f"| {p['tokens']} | peer | not measured: {p['error'][:120]} |")
        else:
            mem = f"{p['peak_mem_gib']:.1f} GiB" if p.get("peak_mem_gib") is not None else "-"
            lines.append(f"| {p['tokens']} | KimiLinearForCausalLM ({p['kernels']}, {p['rows']} rows) | "
                         f"{p['step_s'] * 1e3:.0f} ms | {p['tokens_per_s']:.0f} | {p['mfu'] * 100:.1f}% | {mem} | "
                         "- | - | - | - | - | - | 1.00x |")  # fmt: skip
    for r in report.runs:  # the optimizer apart: clip and AdamW, host dispatch vs device busy time
        o = r.get("components", {}).get("optimizer")
        if o and "clip_s" in o:
            busy = f", device busy {o['device_busy_s'] * 1e3:.0f} ms in {o['kernels']} kernels" if "device_busy_s" in o else ""
            lines.append(f"\n{r['tokens']} tokens, optimizer {o['s'] * 1e3:.0f} ms: clip {o['clip_s'] * 1e3:.0f} ms, AdamW "
                         f"{o['adamw_s'] * 1e3:.0f} ms, host dispatch {o['host_dispatch_s'] * 1e3:.0f} ms{busy}; "
                         f"{o['param_tensors']} parameter tensors, clip foreach: {o['clip_foreach']}")  # fmt: skip
    for r in report.runs:  # host-bound or kernel-bound: the GPU's busy share of the profiled step
        if r.get("device_busy_frac") is not None:
            calls = r.get("compiled_graph_calls") or {}
            graphs = f", compiled-graph calls {calls['forward']} forward / {calls['backward']} backward" if calls else ""
            top = "; ".join(f"{k} {ms:.1f} ms x{n}" for k, ms, n in r.get("top_kernels_ms", [])[:8])
            lines.append(f"\n{r['tokens']} tokens, {r['impl']}, profiled step: GPU busy {r['device_busy_ms']:.0f} of "
                         f"{r['device_span_ms']:.0f} ms ({r['device_busy_frac'] * 100:.0f}%), {r['device_kernels']} kernels"
                         f"{graphs}; top kernels: {top}")  # fmt: skip
            if r.get("device_idle"):
                lines.append(idle_line(r["device_idle"]))
    for r in report.runs:
        if r.get("compiled_regions"):
            regions = ", ".join(f"{k} {v['graphs']} graphs{' (FAILED, eager)' if v['failed'] else ''}"
                                for k, v in r["compiled_regions"].items())  # fmt: skip
            lines.append(f"\n{r['tokens']} tokens, compiled: {regions}; recompile limit hits: "
                         f"{len(r.get('recompile_limit_hits', []))}")  # fmt: skip
    lines += [f"\nnote: {n}" for n in report.notes]
    if report.env.get("resident_before_peer_gib") is not None:
        lines.append(f"\npeer measured alone: {report.env['resident_before_peer_gib']:.2f} GiB of ours left allocated")
    return "\n".join(lines)


def _graph_modes(spec: str) -> list[str]:
    """``--cuda-graphs``: "blocks", "learner" or both separated by ","; each timed in turn."""
    modes = [m for m in spec.split(",") if m]
    bad = [m for m in modes if m not in ("blocks", "learner")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--cuda-graphs {spec!r}: name blocks, learner or blocks,learner")
    return modes


def _fast_paths_list(specs: str) -> list[str]:
    """``--also-fast-paths``: one or more fast-path specs separated by ";" (each checked as ``--fast-paths``)."""
    return [_fast_paths_arg(spec) for spec in specs.split(";") if spec]


def _fast_paths_arg(spec: str) -> str:
    """``--fast-paths``, checked when parsed (``model.fast.FastPaths.parse``: "auto", "reference" or "op=choice,...")."""
    from model.fast import FastPaths

    try:
        FastPaths.parse(spec)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--small", action="store_true", help="CPU, tiny config, fp32: the plumbing only")
    ap.add_argument("--preset", type=Path, default=ROOT / "configs/model/gpu_1b.yaml")
    ap.add_argument("--tokens", default="16384,65536", help="micro-batch sizes to time")
    ap.add_argument("--check-tokens", type=int, default=4096, help="micro-batch of the bf16 check")
    # 6, not 3: the bf16 reference's own error differs from card to card (0.9-7.3e-4 in loss on three H100s against
    # the fast paths' 1.1-13.5e-4, the same on every card), and three batches failed the default paths on one of
    # them while six passed (bench/RESULTS.md, 2026-12-05)
    ap.add_argument("--check-batches", type=int, default=6, help="bf16 check: batches its errors are pooled over")
    ap.add_argument("--check-fp32-tokens", type=int, default=2048, help="micro-batch of the fp32 check (GPU)")
    ap.add_argument("--no-fp32-check", dest="fp32_check", action="store_false", help="GPU: bf16 check only")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpoint", default="none", choices=["none", "layer", "ffn", "attention"])
    ap.add_argument("--compile", action="store_true", help="learner.compile (regional torch.compile)")
    ap.add_argument("--compile-scope", default="auto", help="learner.compile_scope: auto (blocks on a GPU), regions, moe or blocks")
    ap.add_argument("--cuda-graphs", nargs="?", const="blocks", default=None, type=_graph_modes,
                    help="with --compile, timed after: every compiled block as a CUDA graph on this fixed batch "
                    "(blocks, the default), or the learner's own option (learner.cuda_graphs: every block on the "
                    "static layout, the micro-batch padded to a bucket), or both in turn (blocks,learner)")  # fmt: skip
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    ap.add_argument("--peer-first", action="store_true",
                    help="time the peer before ours (its row lands even when a later part of ours runs out of time)")
    ap.add_argument("--peer-row", type=int, default=1024, help="the peer's row length (tokens per sequence)")
    ap.add_argument("--no-components", dest="components", action="store_false")
    ap.add_argument("--profile", action="store_true", help="kernel launches and host syncs of one step")
    ap.add_argument("--profile-graphs", action="store_true",
                    help="profile the --cuda-graphs rows too: kernel time by kernel and GPU busy share of one step")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="skip the per-op probes (auto paths)")
    ap.add_argument("--also-fast-paths", default=[], type=_fast_paths_list,
                    help="an A/B in the same process: check and time ours again on these fast paths after each "
                         "size, e.g. glu=recompute; several variants separated by ';'")  # fmt: skip
    ap.add_argument("--fast-paths", default=None, type=_fast_paths_arg,
                    help="learner.fast_paths for the timed learner, e.g. glu=recompute (skips the probes)")
    ap.add_argument("--memory-breakdown", action="store_true",
                    help="saved-for-backward bytes per layer kind and sub-module (and on a GPU each mode's step peak), first")
    ap.add_argument("--memory-tokens", default="4096,16384", help="micro-batch sizes of the memory breakdown (two or more)")
    ap.add_argument("--memory-modes", default="none-autograd,none,ffn,attention,layer",
                    help="checkpoint modes of the breakdown; none-autograd: no checkpointing and the element-wise "
                         "regions (model.fast glu, attn_res, norm) by plain autograd instead of recomputed")
    ap.add_argument("--memory-target", type=int, default=16384, help="tokens the breakdown extrapolates to")
    ap.add_argument("--memory-episode", type=int, default=2048, help="episode length of the breakdown's batches")
    ap.add_argument("--memory-fp32-cpu", dest="memory_cpu_bf16", action="store_false",
                    help="CPU: the breakdown in fp32 (default: under bf16 autocast, as the GPU learner runs)")
    ap.add_argument("--skip-check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=560.0, help="seconds: no new part starts after this")
    args = ap.parse_args()
    if args.cuda_graphs and not args.compile:
        ap.error("--cuda-graphs replays the compiled blocks: it needs --compile")
    t_start = time.time()
    cuda = torch.cuda.is_available() and not args.small
    if args.small:
        torch.set_num_threads(1)  # tiny ops on a shared CPU: more threads only wait for each other
        arch = dict(SMALL_ARCH)
        if args.tokens == ap.get_default("tokens"):
            args.tokens = "1024,2048"
        args.check_tokens = min(args.check_tokens, 512)
    else:
        arch = load_arch(args.preset)
    report = Report()
    report.env = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "command": " ".join(sys.argv),
        "arch": "small" if args.small else str(args.preset.relative_to(ROOT) if args.preset.is_relative_to(ROOT) else args.preset),
    }  # fmt: skip
    try:
        import transformers

        report.env["transformers"] = transformers.__version__
    except ImportError:
        pass
    clock = Clock(cuda)
    peak = gemm_peak(clock, cuda)
    report.env["gemm_peak_tflops"] = peak / 1e12
    from model.fast import pick

    dev = torch.device("cuda" if cuda else "cpu")
    report.env["fast_paths"] = {op: pick(op, dev) for op in ("moe", "attention", "conv", "lm_head")}
    print(f"[env] {json.dumps(report.env)}", flush=True)
    if args.fast_paths is not None:  # given: no probe
        fast_paths = args.fast_paths
    else:
        fast_paths = probe_ops(report, arch, cuda) if args.probe and not args.skip_check else "auto"
    report.env["fast_paths_spec"] = str(fast_paths)
    report.save(args.out)
    token_sizes = [int(t) for t in args.tokens.split(",") if t]
    if args.peer and args.peer_first:  # alone on the device too: nothing of ours is built yet
        report.env["resident_before_peer_gib"] = torch.cuda.memory_allocated() / 2**30 if cuda else None
        run_peers(report, arch, token_sizes, args, clock, peak, cuda, t_start)
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    sizes = token_sizes + ([int(t) for t in args.memory_tokens.split(",") if t] if args.memory_breakdown else [])
    learner = make_learner(arch, device, dtype, max(sizes), args, fast_paths)
    if not args.skip_check:
        config = learner.base_model.config
        checks = (
            [("float32", args.check_fp32_tokens if cuda else args.check_tokens)]
            if args.fp32_check or not cuda
            else []
        )
        checks += [("bfloat16", args.check_tokens)] if cuda else []
        for variant in (None, *args.also_fast_paths):
            for check_dtype, tokens in checks:  # fp32 holds the kernels to the references tightly; bf16 as timed
                n = args.check_batches if check_dtype == "bfloat16" else 1
                batches = [make_batch(episode_lengths(tokens, np.random.default_rng(s)), config, seed=s)
                           for s in range(1, n + 1)]  # fmt: skip
                with fast_paths_set(learner, variant):
                    ok = check_fast_vs_reference(report, learner, batches, check_dtype == "bfloat16")
                report.save(args.out)
                del batches
                free(cuda)
                if not ok:
                    print(f"[check] the fast paths {variant or ''} disagree with the references: nothing timed",
                          flush=True)  # fmt: skip
                    return 1
    if args.memory_breakdown:  # after the check: its step times are timings too
        run_memory_breakdown(report, learner, args, cuda)
    for tokens in token_sizes:
        if time.time() - t_start > args.budget:
            report.notes.append(f"budget reached before ours at {tokens} tokens")
            continue
        for attempt in range(2):
            try:
                run_ours(report, learner, tokens, args, clock, peak, cuda)
                for variant in args.also_fast_paths:  # the A/B: the same learner, batch and process
                    with fast_paths_set(learner, variant):
                        run_ours(report, learner, tokens, args, clock, peak, cuda, f"ours, {variant}")
                break
            except torch.OutOfMemoryError as e:
                report.notes.append(f"ours at {tokens} tokens, checkpoint={args.checkpoint}: out of memory")
                print(f"[oom] ours {tokens} checkpoint={args.checkpoint}: {str(e)[:200]}", flush=True)
                learner.optimizer.zero_grad(set_to_none=True)
                free(cuda)
                if args.checkpoint != "none" or attempt:
                    break
                from rl.learner import _checkpoint_layers  # once on, it stays on for the later sizes

                _checkpoint_layers(learner.base_model, "layer")
                args.checkpoint = "layer"
        report.save(args.out)
    if args.cuda_graphs:
        run_cuda_graphs(report, learner, token_sizes, args, clock, peak, cuda, t_start)
    if args.peer and not args.peer_first:  # the peer runs alone on the device: our model, optimizer state and caches are gone
        report.env["resident_before_peer_gib"] = release_learner(learner, cuda)
        learner = None
        run_peers(report, arch, token_sizes, args, clock, peak, cuda, t_start)
    report.save(args.out)  # the notes of the last parts (a budget reached) too
    print(markdown(report), flush=True)
    print(f"[done] {time.time() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
