"""Regional torch.compile: the element-wise regions of the model, each with an eager fallback.

Compiled: the functions the modules call with their weights as arguments,
``model.layers.rms_norm`` (every ``RMSNorm``), ``model.attnres.attn_res_mix`` (every ``AttnResMix``; an
engine's take their sources stacked, ``attn_res_mix_stacked``; the learner's run with the norm after them as
one, ``attn_res_mix_norm``, whose backward is ``attn_res_mix_norm_grads``),
``model.layers.glu_activation`` (the reference GLU of every ``GLUMLP``: dense layers, shared and
routed experts), ``model.moe.routing_weights`` (gather, renormalise, scale of every ``MoEGate``),
``kernels.moe.route_tensors`` (the ~25 small integer ops of each grouped MoE's route layout) and the
KDA layer's element-wise work between its projections and kernels (``model.kda.kda_gates``,
``model.layers.l2_normalize_qk``, ``model.kda.kda_output_gate``): an fp32 upcast, a reduction and a
few element-wise ops each, one or two fused kernels instead of five to twenty-five. Also the chunked LM
head's per-chunk math (``model.lm_head.chunk_stats``, ``chunk_logits_grad``): logsumexp, target logprob and
entropy of a [chunk, V] logits block, and their gradient, without writing its fp32 copy. Each is one ``torch.compile`` shared by every module instance, so dynamo compiles
one graph per distinct call signature - (dtype, rank, feature size, number of sources, grad mode) -
and not one per module: a per-instance compile of a bound ``forward`` guards on ``self`` and hit
dynamo's recompile limit (8) after the eighth RMSNorm, the rest then ran eagerly.

Shapes: ``dynamic=False`` plus ``maybe_mark_dynamic`` on every dim but the last of each tensor
argument: the token dims are symbolic (a new micro-batch size reuses the graph; a dim of size 1 is
specialised, dynamo's 0/1 rule), the feature dim stays static (a reduction of known size).
Measured on the CPU with a counting backend: micro-batch sizes 12, 24, 37 share one graph; without
the marks each new size compiled again. ``REGION_RECOMPILE_LIMIT`` (set as dynamo's
``recompile_limit`` when it is lower) covers the real variants with room: gpu_1b has norms of 4
feature sizes (hidden, latent, kv_lora_rank, KDA head) in fp32 and bf16, mixes of 2 to 6 sources,
and each of those with and without gradient (the learner's no-grad logprob passes).

The ``model.fast`` dispatch stays outside the compiled functions: with the "recompute" paths the
non-reentrant checkpoint wraps the compiled call (its recomputation in backward reruns the compiled
forward). The fused Triton SiTU-GLU (CUDA default) is one kernel already and is not compiled. Not
compiled either: the KDA and conv Triton kernels, the grouped GEMMs, attention and the LM head
chunks, which already are single kernels or bring their own. A region whose compilation (or
compiled call) raises runs eagerly for the rest of the process with one warning: a compiler
problem never stops a run, and ``learner.compile=false`` is the switch for debugging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import _StopRecomputationError

log = logging.getLogger(__name__)

REGION_RECOMPILE_LIMIT = 64
OUTSIDE = "(outside the regions)"  # compiles with no region on the stack: lazy backward graphs, others' compiles


class CompileRecord:
    """Dynamo compiles and their wall seconds per compiled region, in this process: which region a slow start
    spends its compile time in (``compile_record()``; the engine's start-up line in bench/startup_probe.py).
    Fed by dynamo's compilation callbacks (``torch._dynamo.callback_handler``: the start and end of each
    outermost frame compile, inductor's codegen and its Triton compiles included), attributed to the region
    being called at the time; a backward graph compiled lazily in the backward pass, or a compile of code
    that is not ours, goes to ``OUTSIDE``. Costs a region's call a list lookup and setting the active name."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.totals: dict[str, list] = {}  # name -> [compiles, seconds, [(compile id, seconds), ...]]
        self.warned = False

    @property
    def active(self) -> str | None:
        return getattr(self.local, "active", None)

    @active.setter
    def active(self, name: str | None) -> None:
        self.local.active = name

    def install(self) -> None:
        """Listen to dynamo's compiles (again after ``torch._dynamo.reset()``, which drops every callback; a
        torch without the callbacks records nothing)."""
        handler = getattr(torch._dynamo, "callback_handler", None)
        if handler is None:
            if not self.warned:
                log.info("torch._dynamo has no callback_handler: compile times per region are not recorded")
                self.warned = True
            return
        if self._start not in handler.start_callbacks:
            handler.register_start_callback(self._start)
            handler.register_end_callback(self._end)

    def _start(self, args=None, *_) -> None:
        compile_id = str(getattr(args, "compile_id", "?"))  # "frame/compile of that frame": "3/1" recompiles frame 3
        self.local.started = (self.active or OUTSIDE, compile_id, time.perf_counter())

    def _end(self, *_) -> None:
        started = getattr(self.local, "started", None)
        if started is None:
            return
        name, compile_id, t0 = started
        self.local.started = None
        seconds = time.perf_counter() - t0
        row = self.totals.setdefault(name, [0, 0.0, []])
        row[0] += 1
        row[1] += seconds
        row[2].append((compile_id, round(seconds, 3)))

    def snapshot(self) -> dict[str, dict]:
        """{region: {"compiles", "seconds", "each": [(dynamo compile id, seconds), ...]}}, the most seconds
        first. A compile id is "frame/n": n > 0 compiled a frame again (a guard failed: new shapes, another
        module's attributes), where another frame id is a frame of its own (code after a graph break)."""
        rows = sorted(self.totals.items(), key=lambda kv: -kv[1][1])
        return {name: {"compiles": n, "seconds": round(s, 3), "each": list(each)} for name, (n, s, each) in rows}


COMPILES = CompileRecord()


def compile_record() -> dict[str, dict]:
    """Compiles and seconds per compiled region so far in this process (``CompileRecord``)."""
    return COMPILES.snapshot()


def mark_token_dims(args: tuple) -> None:
    """Every dim but the last of each tensor argument of rank >= 2 is dynamic (a hint: size 1 stays static)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.ndim >= 2:
            for d in range(a.ndim - 1):
                torch._dynamo.maybe_mark_dynamic(a, d)


class CompiledOrEager:
    """``torch.compile(fn)`` until it raises once, then ``fn`` itself; one per function, shared by
    every module that calls it (deep copies of a model share it too)."""

    def __init__(
        self, fn: Callable, name: str, backend: str | Callable = "inductor", options: dict | None = None,
        dynamic: bool | None = False,
    ):  # fmt: skip
        self.eager, self.name, self.options = fn, name, options
        self.compiled = torch.compile(fn, backend=backend, dynamic=dynamic, options=options)
        self.failed: str | None = None

    def __call__(self, *args):
        if self.failed is None:
            mark_token_dims(args)
            COMPILES.install()  # a list lookup; dynamo's reset() drops the callbacks
            outer, COMPILES.active = COMPILES.active, self.name
            try:
                return self.compiled(*args)
            except _StopRecomputationError:  # checkpoint's early stop of a recomputation: control flow
                raise
            except Exception as e:  # a compiler failure of any kind: run the region eagerly instead
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("torch.compile of %s failed, running it eagerly: %s", self.name, self.failed)
            finally:
                COMPILES.active = outer
        return self.eager(*args)

    def graphs(self) -> int | None:
        """Compiled variants dynamo holds for the function (its cache entries), None where unknown."""
        try:
            return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(self.eager))
        except Exception:  # a private helper: a torch without it
            return None

    def __deepcopy__(self, memo) -> CompiledOrEager:
        return self

    def __repr__(self) -> str:
        return f"CompiledOrEager({self.name}{', failed' if self.failed else ''})"


def region_kinds() -> tuple[tuple[type, str, Callable], ...]:
    """(module class, attribute, function) of every compiled region of the model: the module's attribute
    holds the function it calls."""
    from kernels.moe import route_tensors
    from model.attnres import (
        AttnResMix,
        attn_res_mix,
        attn_res_mix_norm,
        attn_res_mix_norm_grads,
        attn_res_mix_stacked,
    )
    from model.kda import KimiDeltaAttention, kda_gates, kda_output_gate
    from model.layers import GatedActivation, RMSNorm, glu_activation, l2_normalize_qk, rms_norm
    from model.lm_head import chunk_logits_grad, chunk_stats
    from model.modeling import HybridForCausalLM
    from model.moe import GroupedExperts, MoEGate, routing_weights

    return (
        (RMSNorm, "norm_fn", rms_norm), (AttnResMix, "mix_fn", attn_res_mix),
        (AttnResMix, "stacked_mix_fn", attn_res_mix_stacked), (AttnResMix, "mix_norm_fn", attn_res_mix_norm),
        (AttnResMix, "mix_norm_grads_fn", attn_res_mix_norm_grads),
        (GatedActivation, "glu_fn", glu_activation),
        (MoEGate, "weights_fn", routing_weights), (GroupedExperts, "route_fn", route_tensors),
        (KimiDeltaAttention, "gates_fn", kda_gates), (KimiDeltaAttention, "qk_norm_fn", l2_normalize_qk),
        (KimiDeltaAttention, "out_gate_fn", kda_output_gate),
        (HybridForCausalLM, "head_stats_fn", chunk_stats), (HybridForCausalLM, "head_grad_fn", chunk_logits_grad),
    )  # fmt: skip


def block_kinds(scope: str) -> tuple[tuple[type, str, Callable], ...]:
    """The whole blocks compiled at ``scope``: "regions" none; "moe" every MoE block's forward (router,
    routing, permutation, grouped GEMMs, combine, latent projections and shared expert: one graph per
    call signature for all MoE layers); "blocks" the MoE blocks and every KDA layer's forward: whole on the
    planned path (training and no-grad passes on the Triton kernels, ``model.kda.kda_planned_forward``: its
    convolutions and kernel inside), else its projections, norms, gates and gated output with the short
    convolutions and the kernel outside (``model.kda.kda_forward``); and every MLA layer without a cache whose
    attention takes the one-call ``varlen`` form (``model.mla.mla_planned_forward``)."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope must be one of {COMPILE_SCOPES}, got {scope!r}")
    from model.kda import KimiDeltaAttention, kda_forward, kda_planned_forward
    from model.mla import GatedMLA, mla_planned_forward
    from model.moe import SparseMoE, sparse_moe_forward

    moe = ((SparseMoE, "forward_fn", sparse_moe_forward),)
    kda = ((KimiDeltaAttention, "forward_fn", kda_forward), (KimiDeltaAttention, "planned_fn", kda_planned_forward))
    mla = ((GatedMLA, "planned_fn", mla_planned_forward),)
    return {"regions": (), "moe": moe, "blocks": (*moe, *kda, *mla)}[scope]


COMPILE_SCOPES = ("regions", "moe", "blocks")
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True}  # inductor's option behind torch.compile(mode="reduce-overhead")


def resolve_compile_scope(scope: str, device: torch.device | str, on_cuda: str) -> str:
    """``scope``, or for "auto" the one measured fastest on a GPU (``on_cuda``: "blocks" for the learner,
    "moe" for the engine, bench/RESULTS.md) and "regions" elsewhere: the CPU's grouped GEMM takes bf16
    only, so an fp32 MoE block compiled whole would fall back to eager there."""
    if scope == "auto":
        return on_cuda if torch.device(device).type == "cuda" else "regions"
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope must be auto or one of {COMPILE_SCOPES}, got {scope!r}")
    return scope


def compile_regions(
    model: nn.Module,
    backend: str | Callable = "inductor",
    extra_kinds: tuple[tuple[type, str, Callable], ...] = (),
    options: dict | None = None,
    scope: str = "regions",
    cuda_graphs: bool | str = False,
) -> list[CompiledOrEager]:
    """Point every norm, AttnRes mix, GLU, router, grouped MoE and KDA layer of ``model`` (and the modules
    of ``extra_kinds``: the vLLM model's decode step) at the shared compiled functions; returns the
    wrappers (one per function that ``model`` has modules for). ``options``: inductor's, e.g.
    ``{"emulate_precision_casts": True}`` (the engine: bf16 rounded between fused ops as eager rounds it).
    ``scope`` (``block_kinds``): blocks compiled whole; the regions inside them stay plain functions that
    the block's graph traces through (one compile, fused with the block's other element-wise work). A module
    whose attribute is None does not take that path (an AttnRes mix outside an engine: no stacked mix) and
    gets no wrapper there. ``cuda_graphs``: the blocks' graphs replay as CUDA graphs (inductor's cudagraph
    trees, ``CUDA_GRAPH_OPTIONS``): one launch for a block's kernels instead of one each, a graph recorded per
    input shape; True or "blocks" every block of ``scope``, "moe" the MoE blocks only (their inputs' shapes
    follow the token count alone; a KDA or MLA layer's also follow the sequences' lengths unless the layout is
    static, ``model.layers.seq_layout(static=True)``, as ``learner.cuda_graphs`` builds it). Steps begin with
    ``torch.compiler.cudagraph_mark_step_begin()``."""
    if cuda_graphs not in (False, True, "blocks", "moe"):
        raise ValueError(f"cuda_graphs must be False, True, 'blocks' or 'moe', got {cuda_graphs!r}")
    if cuda_graphs and scope == "regions":
        raise ValueError("cuda_graphs replays compiled blocks: it needs compile scope 'moe' or 'blocks', got 'regions'")
    graphed = {"moe": block_kinds("moe")}.get(cuda_graphs, block_kinds(scope) if cuda_graphs else ())
    if torch._dynamo.config.recompile_limit < REGION_RECOMPILE_LIMIT:
        log.info("dynamo recompile_limit %d -> %d (compiled regions)", torch._dynamo.config.recompile_limit,
                 REGION_RECOMPILE_LIMIT)  # fmt: skip
        torch._dynamo.config.recompile_limit = REGION_RECOMPILE_LIMIT
    blocks = block_kinds(scope)
    inside = {id(sub) for m in model.modules() if isinstance(m, tuple(c for c, _, _ in blocks)) for sub in m.modules()}
    kinds = (*region_kinds(), *extra_kinds)
    regions: dict[Callable, CompiledOrEager] = {}  # by function: two kinds may share an attribute name
    for module in model.modules():
        for cls, attr, fn in (*blocks, *(() if id(module) in inside else kinds)):
            if isinstance(module, cls) and getattr(module, attr, None) is not None:  # None: a path not taken
                if fn not in regions:
                    # a block's graph breaks resume in frames whose inputs carry no dynamic marks: there
                    # dynamo's automatic dynamic shapes (dynamic=None) make a new token count symbolic on
                    # its first recompile, where dynamic=False would compile every new count again
                    is_block = (cls, attr, fn) in blocks
                    opts = {**(options or {}), **CUDA_GRAPH_OPTIONS} if (cls, attr, fn) in graphed else options
                    regions[fn] = CompiledOrEager(fn, fn.__name__, backend, opts, None if is_block else False)
                setattr(module, attr, regions[fn])
    return list(regions.values())
