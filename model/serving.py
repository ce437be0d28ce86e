"""The model prepared for serving (the rollout engine), free of vLLM: inference-only changes that leave its
function as it is and make a step cheaper.

* ``fuse_feed_forward_inputs``: the projections that read the same input as one GEMM (``fuse_linears``);
* ``counting_layout_over``: every grouped MoE ranks its route layout's slots one way for every step the
  engine can form, so a compiled MoE block compiles once;
* ``route_decode_steps_in_single_launches``: on CUDA, a decode step's expert selection as one Triton launch, its
  SiTU experts up to the down product as one, its route layout as two (``LONGHORIZON_DECODE_ROUTE_LAYOUT``);
* ``inductor_compile_threads``: inductor's compile workers, which ``import vllm`` pins to one;
* ``kda_state_shapes`` / ``kda_state_dtypes``: a KDA layer's (or a stack of layers') per-sequence states in an
  engine's slots;
* ``prepare_for_serving``: the first three, the AttnRes mixes over stacked sources (on CUDA one kernel over the
  sources where they are), and eval mode without gradients, what the vLLM model (``rollout.vllm_model``) and
  bench/moe_compile.py do to the learner's modules (the vLLM model sets the compile workers when it compiles).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kernels.attnres import attn_res_mix_norm_sources_triton
from model.attnres import AttnResMix, attn_res_mix_stacked
from model.layers import GLUMLP
from model.moe import GroupedExperts, MoEGate, SparseMoE


def fuse_linears(linears: list[nn.Module]) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """(fused weight [sum of outputs, d], output sizes) of linears that read the same input: one contiguous
    weight, each nn.Linear's weight a view of its rows, so weight loads and in-place updates (``load_weights``,
    adapter folds: ``copy_`` into the named parameters) write the fused weight itself and one GEMM computes
    all the outputs. (None, ()) when one is not a plain bias-free nn.Linear (a wrapped one keeps its own call).
    Inference only: a parameter made a view of a plain tensor gets no gradient through the fused product."""
    if not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return None, ()
    w = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(w[start : start + rows], requires_grad=m.weight.requires_grad)
        start += rows
    return w, tuple(m.weight.shape[0] for m in linears)


def fuse_feed_forward_inputs(module: nn.Module) -> None:
    """The engine's fused input GEMMs of a decoder layer's feed-forward block (``fuse_linears``): a dense GLU's
    gate and up projections (``GLUMLP.gate_up_weight``), and a latent MoE's down projection into the experts'
    space with its shared expert's gate and up (``SparseMoE.fused_input``): one GEMM of x where there were
    two or three, 31 fewer launches a decode step at gpu_1b."""
    if isinstance(module, GLUMLP):
        w, _ = fuse_linears([module.gate_proj, module.up_proj])
        module.gate_up_weight = w
    elif isinstance(module, SparseMoE) and module.latent and module.shared_experts is not None:
        shared = module.shared_experts
        w, sizes = fuse_linears([module.routed_expert_down_proj, shared.gate_proj, shared.up_proj])
        module.fused_input = None if w is None else (w, sizes)


DEFAULT_COMPILE_THREADS = 8


def inductor_compile_threads(value: str | None, on_cuda: bool = False) -> int | None:
    """Set inductor's compile workers from ``value`` (unset: ``DEFAULT_COMPILE_THREADS`` on a GPU, capped by
    the cores; left alone on a CPU, where a small machine has no cores to spare). ``import vllm`` pins them
    to 1 (TORCHINDUCTOR_COMPILE_THREADS, vLLM issues 10480 / 10619), so inductor compiled the regions' Triton
    kernels one after another: with 8 workers gpu_1b's cold first call on an H200 went 79 -> 48 s (Triton
    compiles in the process 144 / 26.7 s -> 42 / 9.7 s, bench/RESULTS.md). Returns the count set."""
    if value is None or value == "":
        if not on_cuda:
            return None
        threads = max(1, min(DEFAULT_COMPILE_THREADS, os.cpu_count() or 1))
    else:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"LONGHORIZON_COMPILE_THREADS must be a positive integer, got {value!r}")
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = threads
    return threads


COUNTING_LAYOUT_ENGINE_MAX = 1 << 25  # slots x experts: 32K tokens a step at top-8 of 128 experts


def counting_layout_over(model: nn.Module, slots: int) -> None:
    """Rank the route layout's slots by counting (``kernels.moe.route_tensors``) up to ``slots`` slots a step
    (the scheduler's token budget x top-k) in every grouped MoE of ``model``. Under the default limit a step
    over 1,024 gpu_1b tokens sorts and a smaller one counts; in a compiled MoE block that choice is a guard,
    and each side compiles the block (vLLM's profile run on one side, the decode graphs on the other): one
    path for every step is one compile. The cost is the [E, S] prefix sum of the largest step: 16K tokens x
    8 x 128 experts (vLLM's default budget on an H200), 134 MB of int64 for a moment; a budget past
    ``COUNTING_LAYOUT_ENGINE_MAX`` (268 MB) keeps sorting its large steps, at the price of the second compile."""
    from kernels.moe import COUNTING_LAYOUT_MAX

    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.counting_layout_max = max(COUNTING_LAYOUT_MAX, min(slots * m.num_experts, COUNTING_LAYOUT_ENGINE_MAX))


def kda_state_shapes(config, depth: int = 1) -> tuple[tuple[int, ...], ...]:
    """The four per-sequence states of a KDA layer in an engine's slots: the q, k and v short convolutions'
    windows [H * D, kernel - 1] and the recurrent state [H, D, D]; with ``depth`` > 1, those of ``depth``
    layers stacked in one slot ([depth, ...] each: ``rollout.vllm_layers.KDAStates``)."""
    lac = config.linear_attn_config
    H, D, K = int(lac["num_heads"]), int(lac["head_dim"]), int(lac["short_conv_kernel_size"])
    conv = (H * D, K - 1)
    shapes = (conv, conv, conv, (H, D, D))
    return shapes if depth == 1 else tuple((depth, *s) for s in shapes)


def kda_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The convolution windows in the model's dtype, the recurrent state in fp32."""
    return (model_dtype, model_dtype, model_dtype, torch.float32)


def prepare_for_serving(model: nn.Module, max_step_tokens: int) -> None:
    """``model`` (a causal LM, a decoder stack or one block) for inference in an engine whose steps hold at
    most ``max_step_tokens`` tokens: eval mode, no gradients, each feed-forward block's inputs fused (a MoE's
    shared expert is fused with the MoE's latent projection, not on its own), the route layout counted over
    the largest step (top-k slots a token), and the AttnRes mixes given their sources stacked
    (``attn_res_mix_stacked``: one compiled graph whatever the number of sources); on CUDA each mix and the
    sub-layer's norm after it are one Triton kernel reading the sources where they are
    (``kernels.attnres.attn_res_mix_norm_sources_triton``: 1 launch a mix where the compiled mix and the norm made
    5, and the stacked sources' kernel 2; no compile of the mix at the engine's start), and a decode step's expert
    selection and SiTU experts are one launch each (``route_decode_steps_in_single_launches``)."""
    model.eval()
    model.requires_grad_(False)
    on_cuda = any(p.is_cuda for p in model.parameters())
    for m in model.modules():
        if isinstance(m, AttnResMix):  # sources stacked before the mix: one compiled graph for every count
            m.stacked_mix_fn = attn_res_mix_stacked
            m.sources_mix_norm_fn = attn_res_mix_norm_sources_triton if on_cuda else None
    shared = {id(m.shared_experts) for m in model.modules() if isinstance(m, SparseMoE)}
    for m in list(model.modules()):
        if isinstance(m, SparseMoE) or (isinstance(m, GLUMLP) and id(m) not in shared):
            fuse_feed_forward_inputs(m)
    top_k = max((m.top_k for m in model.modules() if isinstance(m, MoEGate)), default=0)
    if top_k:
        counting_layout_over(model, max_step_tokens * top_k)
    if on_cuda:
        route_decode_steps_in_single_launches(model)


DECODE_ROUTE_LAYOUTS = ("compiled", "triton")
PREFILL_ROUTINGS = ("triton", "torch")


def route_decode_steps_in_single_launches(model: nn.Module) -> None:
    """Every router of ``model`` selects its experts and weights from its logits with
    ``kernels.moe.triton.select_experts_engine`` (a decode step's sigmoid, top-k and weights in one Triton launch,
    where the compiled block ran the sigmoid, a single-block radix sort and the weights' gather as three kernels),
    its top-k with ``top_experts_engine`` where routes are replayed, and every grouped MoE of SiTU experts runs the
    permute, the gate/up product and the activation with ``kernels.moe.triton.permute_situ_engine`` (a decode
    step's in one launch, where they were three kernels), and lays out its routes with
    ``kernels.moe.triton.route_tensors_engine`` (two launches, where the compiled layout is about eight kernels a
    MoE layer: 4.7 against 8.4 us at 64 sequences on an H100, bench/grouped_mm_decode.py --layout);
    ``LONGHORIZON_DECODE_ROUTE_LAYOUT=compiled`` keeps the compiled layout. A prefill step's selection and layout take
    the same kernels too (the layout in three launches, ``route_tensors_large``: the same groups as the torch steps
    on an H100, 4-10x faster at 2K-16K tokens, bench/grouped_mm_decode.py --layout), where the ops would run the
    torch steps eagerly (about 35 ops a MoE layer, ~1.4 ms of a slow host's time);
    ``LONGHORIZON_PREFILL_ROUTING=torch`` keeps those. Inside a MoE block compiled whole (the engine's scope on CUDA)
    the block's graph calls the ops; a scope that compiles the layout as a region of its own (``model.compile``'s
    "regions") swaps that back to the compiled ``route_tensors``."""
    from kernels.moe.triton import (
        permute_situ_engine,
        route_tensors_engine,
        select_experts_engine,
        set_prefill_routing,
        top_experts_engine,
    )

    layout = os.environ.get("LONGHORIZON_DECODE_ROUTE_LAYOUT", "triton")
    if layout not in DECODE_ROUTE_LAYOUTS:
        raise ValueError(f"LONGHORIZON_DECODE_ROUTE_LAYOUT must be one of {DECODE_ROUTE_LAYOUTS}, got {layout!r}")
    prefill = os.environ.get("LONGHORIZON_PREFILL_ROUTING", "triton")
    if prefill not in PREFILL_ROUTINGS:
        raise ValueError(f"LONGHORIZON_PREFILL_ROUTING must be one of {PREFILL_ROUTINGS}, got {prefill!r}")
    set_prefill_routing(prefill == "triton")
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            if layout == "triton":
                m.route_fn = route_tensors_engine
            if m.act == "situ":
                m.permute_glu_fn = permute_situ_engine
        elif isinstance(m, MoEGate):
            m.top_fn, m.select_fn = top_experts_engine, select_experts_engine
