"""Sparse MoE with K3's sigmoid router, shared experts and (optionally) latent experts.

Router (``MoEGate``, DeepSeek/NeMo naming: ``gate.weight``, ``gate.e_score_correction_bias``):
s = sigmoid(W_r x) in fp32 (autocast off around it); experts = top-k of (s + b); weights = the *unbiased* s of the chosen
experts, renormalised (moe_renormalize), times routed_scaling_factor. b is a buffer (no gradient)
set by ``model.balancing.ExpertBalancer``. With ``num_expert_group`` > 1 (DeepSeek-V3 group-limited
routing, off for K3 and Kimi Linear) only experts of the ``topk_group`` groups with the largest
sum of their two best biased scores are selectable; balancing statistics then see the masked scores.

Routing replay (R3): given expert indices [T, k] are used for the selection while the weights are
still the router's s at those indices, so the router keeps learning. A token whose row is all -1 (the
engine did not compute it) is routed freely, in the same forward.

Stable LatentMoE (K3): z = routed_expert_down_proj(x); u = sum_i p_i E_i(z);
y = shared_experts(x) + routed_expert_up_proj(RMSNorm(u)). Without routed_expert_hidden_size the
experts act on x directly (DeepSeek-style).

The routed experts are one module, ``GroupedExperts``, holding two stacked weights in nn.Linear layout
per expert: ``experts.gate_up_proj`` [E, 2I, Z] (expert e's gate rows, then its up rows) and
``experts.down_proj`` [E, Z, I], the names and layout of transformers' own MoE models. One parameter per
weight kind, not per expert: 2 tensors per layer instead of 3E (384 at gpu_1b), so the forward does not
stack them, the backward does not accumulate 3E gradients, and the optimizer, FSDP and weight sync walk
two tensors. Checkpoints on disk keep one tensor per expert (``experts.N.gate_proj.weight``, ...,
Moonshot's and DeepSeek's layout): ``save_pretrained`` splits, ``from_pretrained`` stacks (a transformers
conversion mapping, ``expert_conversions``), and ``stack_expert_weights`` does the same for streams of
named tensors (the vLLM model's loader). LoRA reaches the experts through PEFT's ``target_parameters``
(one rank-r adapter per expert, ``model.lora``).

Two implementations of the routed sum (``model.fast``, op "moe"): ``loop``, the readable reference
(one GLU per expert on its tokens; the per-expert counts are read on the host), and ``grouped``
(``kernels.moe``: slots sorted by expert on the device, the gate/up and down projections of all
experts as two grouped GEMMs, results gathered back; no host sync; the weighted fp32 sum over the
k slots is one autograd node, ``kernels.moe.combine``, which keeps the gathered rows but not their fp32
[T, k, Z] product).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.glu import GluActivation
from kernels.moe import route_tensors
from model import fast
from model.balancing import RoutingStats, histogram_range
from model.config import HybridConfig
from model.layers import GLUMLP, GatedActivation, RMSNorm, cast_once, compute_dtype, f32


def routing_weights(
    scores_TE: torch.Tensor, experts_TK: torch.Tensor, renormalize: bool, scaling: float
) -> torch.Tensor:
    """The chosen experts' unbiased scores, renormalised over the k and scaled (a multiply by 1.0 is
    skipped): a function of tensors and constants, compiled as one region by ``model.compile``."""
    weights_TK = scores_TE.gather(-1, experts_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True).clamp(min=1e-20)
    if scaling != 1.0:
        weights_TK = weights_TK * scaling
    return weights_TK


def select_experts(
    logits_TE: torch.Tensor, bias_E: torch.Tensor, n: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, n], weights [T, n]) from router logits as ``MoEGate.forward`` selects them without groups,
    replayed routes or statistics: sigmoid scores, the top n of scores + bias (``top_experts``), the chosen
    unbiased scores through ``routing_weights``. The reference of the engine's one-launch selection
    (``kernels.moe.triton.select_experts_engine``)."""
    scores_TE = torch.sigmoid(logits_TE)
    experts_TK = top_experts(scores_TE + bias_E.to(scores_TE.dtype), n)[1]
    return experts_TK, routing_weights(scores_TE, experts_TK, renormalize, scaling)


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """W_r x in fp32. When x and W are both bf16 on CUDA (the engine's model) the product runs on the tensor
    cores with fp32 accumulation and an fp32 result (``aten::mm.dtype``): each product of two bf16 values is
    exact in fp32, so this is the fp32 GEMM's math summed in another order. cuBLAS's fp32 kernel for a decode
    batch ([8, 1024] x [1024, 128], no tensor cores) took 52 us per call on an H200, the largest kernel of a
    decode step. The learner's fp32 weights take the fp32 GEMM."""
    if x_TD.is_cuda and x_TD.dtype == w_ED.dtype == torch.bfloat16 and _MM_OUT_DTYPE["ok"]:
        try:
            s_TE = torch.mm(x_TD.reshape(-1, x_TD.shape[-1]), w_ED.t(), out_dtype=torch.float32)
            return s_TE.view(*x_TD.shape[:-1], w_ED.shape[0])
        except RuntimeError as e:  # a torch or GPU without the kernel: the fp32 GEMM from now on
            _MM_OUT_DTYPE["ok"] = False
            logging.getLogger(__name__).warning("bf16 router GEMM with an fp32 result unavailable (%s): fp32 GEMM", e)
    return F.linear(f32(x_TD), f32(w_ED))


_MM_OUT_DTYPE = {"ok": hasattr(torch.ops.aten.mm, "dtype")}  # torch.mm(..., out_dtype=) (CUDA kernels)


def top_experts(biased_TE: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest scores of each row and their experts, in descending order, ties to the lower expert id:
    one stable sort of the E scores. On CUDA that is one kernel (a block sort of 128 scores: 4 us for a decode
    batch on an H200), where ``topk`` runs a selection and then sorts what it selected (11 us, once per MoE layer
    and step); the experts are the top-k's but for exact ties, whose order this fixes. Under ``torch.compile``
    the sort is the opaque op ``sort_expert_scores``, the same kernel (no gradient flows here: the scores are
    detached)."""
    sort = sort_expert_scores if torch.compiler.is_compiling() else _sort_desc
    vals_TE, idx_TE = sort(biased_TE)
    return vals_TE[:, :n], idx_TE[:, :n]


def _sort_desc(scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vals_TE, idx_TE = scores_TE.sort(dim=-1, descending=True, stable=True)
    return vals_TE, idx_TE


@torch.library.custom_op("longhorizon::sort_expert_scores", mutates_args=())
def sort_expert_scores(scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's scores sorted descending, stable, and their expert ids, as an op inductor calls rather than
    generates: it lowers the sort of a row of 128 scores into a Triton bitonic sort whose compile took 30 s
    of the engine's 44 s MoE block compile on an H200 (bench/moe_compile.py); eager's kernel runs instead."""
    return _sort_desc(scores_TE)


@sort_expert_scores.register_fake
def _(scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(scores_TE), torch.empty_like(scores_TE, dtype=torch.long)


@dataclass
class RouterOutput:
    experts_TK: torch.Tensor  # long, the experts used
    weights_TK: torch.Tensor  # fp32 routing weights (differentiable w.r.t. the router)


def check_replay_ids(replay: torch.Tensor, num_experts: int) -> None:
    """Replayed ids lie in [0, num_experts), or a token's whole row is -1 (route it freely)."""
    if not replay.numel():
        return
    # two passes of min/max, not six of comparisons: a learner micro-batch's host table ([16K, 15, 8] at gpu_1b)
    # took 45 ms a step to check element-wise on an H200's host, longer than the GPU had work queued
    lo, hi = (int(v) for v in replay.aminmax())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"replayed expert ids must lie in [0, {num_experts}), or be -1 (route freely)")
    if lo == -1:  # a row with a -1 must be all -1: its largest id is -1 too
        row_lo, row_hi = replay.reshape(-1, replay.shape[-1]).aminmax(dim=-1)
        if bool(((row_lo == -1) & (row_hi != -1)).any()):
            raise ValueError("a replayed token's experts are all -1 (route it freely) or none of them")


class MoEGate(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_token
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.num_groups, self.topk_groups = config.num_expert_group, config.topk_group
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.balancing_mode = config.moe_balancing
        self.balancing_rate = config.moe_balancing_rate
        self.balancing_bins = config.moe_balancing_bins
        self.balancing_quantile = config.moe_balancing_quantile
        self._stats: RoutingStats | None = None
        self._balancer_attached = False  # statistics pile up only while an ExpertBalancer consumes them
        # the current forward's trailing filler tokens (a learner's bucket padding), which the statistics leave out:
        # set around a forward by ``HybridModel`` (``filler_tokens``), read only by the eager ``_record``
        self.uncounted_tokens = 0
        # ``model.compile.compile_regions`` swaps in the compiled one
        self.weights_fn: Callable = routing_weights
        # the top-k selection (``top_experts``; a CUDA engine's ``kernels.moe.triton.top_experts_engine``)
        self.top_fn: Callable = top_experts
        # inference without replayed routes or groups: the whole selection from the logits as one function of
        # (logits, bias, k, renormalize, scaling) -> (experts, weights) (a CUDA engine's
        # ``kernels.moe.triton.select_experts_engine``, set by ``model.serving``); None: the steps in ``forward``
        self.select_fn: Callable | None = None
        nn.init.normal_(self.weight, std=config.initializer_range)

    def _apply(self, fn, recurse=True):
        """Keep the selection bias in fp32 under model.to(bf16): QB moves it by less than a bf16 ulp."""
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias.dtype not in (torch.float32, torch.float64):
            self.e_score_correction_bias = bias.float()
        return self

    def set_balancing(self, mode: str, bins: int) -> None:
        """Called by ExpertBalancer: from now on training forwards record routing statistics."""
        self.balancing_mode, self.balancing_bins, self._stats = mode, bins, None
        self._balancer_attached = True

    def empty_stats(self) -> RoutingStats:
        stats = RoutingStats(load_E=torch.zeros(self.num_experts, device=self.weight.device))
        if self.balancing_mode == "quantile_histogram":
            stats.hist_range = histogram_range(self.e_score_correction_bias)
            stats.hist_EB = torch.zeros(
                self.num_experts, self.balancing_bins, dtype=torch.long, device=self.weight.device
            )
        return stats

    def pop_stats(self) -> RoutingStats | None:
        stats, self._stats = self._stats, None
        return stats

    def forward(
        self, x_TD: torch.Tensor, replay_TK: torch.Tensor | None = None, replay_checked: bool = False
    ) -> RouterOutput:
        """``replay_checked``: the caller already validated the replayed ids (HybridModel does so
        once per forward, so that no MoE layer reads them on the host)."""
        # only gradient-carrying training forwards count: no-grad passes (old logprobs, replay
        # lookups) would add their tokens a second time
        collect = (
            self.training
            and self._balancer_attached
            and self.balancing_mode != "frozen"
            and torch.is_grad_enabled()
        )
        with torch.autocast(x_TD.device.type, enabled=False):  # fp32 even under autocast (its bias is fp32)
            logits_TE = router_logits(x_TD, self.weight)
            if self.select_fn is not None and replay_TK is None and self.num_groups <= 1 and not collect:
                bias = self.e_score_correction_bias
                args = (logits_TE, bias, self.top_k, bool(self.renormalize), float(self.scaling))
                return RouterOutput(*self.select_fn(*args))
            scores_TE = torch.sigmoid(logits_TE)
        biased_TE = scores_TE.detach() + self.e_score_correction_bias.to(scores_TE.dtype)
        if self.num_groups > 1:
            biased_TE = self._limit_to_groups(biased_TE)
        needs_cutoff = collect and self.balancing_mode.startswith("quantile")  # alpha_i = (k+1)-th value
        top_vals, top_idx = self.top_fn(biased_TE, self.top_k + 1 if needs_cutoff else self.top_k)
        experts_TK = top_idx[:, : self.top_k]
        if replay_TK is not None:  # a token whose row is -1 keeps its own top-k (routed freely)
            if not replay_checked:
                replay_TK = self._check_replay(replay_TK, x_TD.shape[0])
            replay_TK = replay_TK.to(experts_TK)
            experts_TK = torch.where(replay_TK >= 0, replay_TK, experts_TK)
        weights_TK = self.weights_fn(scores_TE, experts_TK, self.renormalize, self.scaling)
        if collect:
            self._record(scores_TE, top_vals[:, -1], experts_TK)
        return RouterOutput(experts_TK, weights_TK)

    def _limit_to_groups(self, biased_TE: torch.Tensor) -> torch.Tensor:
        """-inf outside the topk_group best groups (group score: sum of its two best biased scores)."""
        T, E = biased_TE.shape
        grouped_TGN = biased_TE.view(T, self.num_groups, E // self.num_groups)
        group_scores_TG = grouped_TGN.topk(2, dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_scores_TG.topk(self.topk_groups, dim=-1).indices, True)
        return grouped_TGN.masked_fill(~keep_TG[..., None], float("-inf")).view(T, E)

    def _check_replay(self, replay_TK: torch.Tensor, T: int) -> torch.Tensor:
        if tuple(replay_TK.shape) != (T, self.top_k):
            raise ValueError(
                f"replayed experts must be [T, top_k] = [{T}, {self.top_k}], got {tuple(replay_TK.shape)}"
            )
        check_replay_ids(replay_TK, self.num_experts)
        return replay_TK.long()

    @torch.compiler.disable  # eager inside a compiled MoE block: a graph break only while statistics are collected
    @torch.no_grad()
    def _record(self, scores_TE, cutoff_T, experts_TK) -> None:
        """Add this forward's routing to the step's statistics, its trailing ``uncounted_tokens`` left out. Eager
        (outside any compiled graph): the statistics outlive the forward, where a graph's outputs under CUDA
        graphs would be overwritten by its next replay, and the filler count is a plain attribute, not a guard."""
        if self._stats is None:
            self._stats = self.empty_stats()
        n = scores_TE.shape[0] - self.uncounted_tokens
        bias = self.e_score_correction_bias
        self._stats.record(self.balancing_mode, scores_TE[:n], cutoff_T[:n], experts_TK[:n], bias, self.balancing_bins)


class SparseMoE(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        d, act = config.hidden_size, config.hidden_act
        betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        self.gate = MoEGate(config)
        latent = config.routed_expert_hidden_size
        self.expert_dim = latent or d
        if latent:
            self.routed_expert_down_proj = nn.Linear(d, latent, bias=False)
            # K3's "Stable" LatentMoE normalises the expert mixture before the up projection
            self.routed_expert_norm = (
                RMSNorm(latent, eps=config.rms_norm_eps) if config.latent_moe_use_norm else nn.Identity()
            )
            self.routed_expert_up_proj = nn.Linear(latent, d, bias=False)
        self.experts = GroupedExperts(config.num_experts, self.expert_dim, config.moe_intermediate_size, act, betas)
        self.shared_experts = (
            GLUMLP(d, config.moe_intermediate_size * config.num_shared_experts, act, betas)
            if config.num_shared_experts
            else None
        )
        self.latent = bool(latent)
        # the rollout engine's (fused weight, sizes) of the latent down projection and the shared expert's gate and
        # up, which all read x (``model.serving.fuse_feed_forward_inputs``): one GEMM; None in training
        self.fused_input: tuple[torch.Tensor, tuple[int, ...]] | None = None
        # ``model.compile.compile_regions`` with scope "moe" swaps in the compiled one
        self.forward_fn: Callable = sparse_moe_forward

    def forward(
        self, x_BTD: torch.Tensor, replay_TK: torch.Tensor | None = None, replay_checked: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_BTD, experts used [B*T, k])."""
        fn = self.forward_fn
        experts = getattr(self.experts, "get_base_layer", lambda: self.experts)()  # under PEFT's LoRA wrappers
        if fast.pick("moe", x_BTD.device) != "grouped" or experts.dispatch is not None:
            # the reference loop reads per-expert counts on the host (a graph would be recompiled for every
            # new split of the tokens) and expert parallelism exchanges tokens between ranks: both eager
            fn = sparse_moe_forward
        return fn(self, x_BTD, replay_TK, replay_checked)


def sparse_moe_forward(
    moe: SparseMoE, x_BTD: torch.Tensor, replay_TK: torch.Tensor | None, replay_checked: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``SparseMoE.forward``: a function of the module, so that ``model.compile`` (scope "moe") compiles
    one graph for every MoE layer (the module is an argument, its weights graph inputs)."""
    B, T, D = x_BTD.shape
    x_TD = x_BTD.reshape(B * T, D)
    route = moe.gate(x_TD, replay_TK, replay_checked)  # fp32, from x as given
    # one compute-dtype copy of x for the projections below (the shared expert's gate and up then sum
    # their input gradients in that dtype, a bf16 add, where per-Linear casts summed them in fp32)
    xc_TD = cast_once(x_TD)
    shared_TD = None
    if moe.fused_input is not None:  # the engine: z and the shared expert's gate and up in one GEMM of x
        w_in, sizes = moe.fused_input
        z_TZ, g_TI, u_TI = F.linear(xc_TD(), w_in).split(sizes, dim=-1)
        shared_TD = moe.shared_experts.down_proj(moe.shared_experts.glu(g_TI, u_TI))
    else:
        z_TZ = moe.routed_expert_down_proj(xc_TD()) if moe.latent else x_TD
    u_TZ = moe.experts(z_TZ, route)
    y_TD = moe.routed_expert_up_proj(moe.routed_expert_norm(u_TZ)) if moe.latent else u_TZ
    if moe.shared_experts is not None:
        y_TD = y_TD + (shared_TD if shared_TD is not None else moe.shared_experts(xc_TD()))
    return y_TD.view(B, T, D), route.experts_TK


class GroupedExperts(GatedActivation, nn.Module):
    """The E routed experts of one MoE layer, GLUs Z -> I -> Z, as two stacked weights (module docstring).

    ``forward(z_TZ, route)`` = sum_j w_tj E_{e_tj}(z_t), through the implementation ``model.fast`` op "moe"
    picks. The weights are read once per forward (under PEFT's LoRA each read of a wrapped parameter
    merges its adapter)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "situ", situ_betas=(4.0, 25.0)):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self._init_activation(act, situ_betas)
        self.route_fn: Callable = route_tensors  # ``model.compile`` swaps in a compiled one
        # slots x experts up to which the route layout ranks slots by counting, not sorting (None:
        # kernels.moe.COUNTING_LAYOUT_MAX; the engine raises it over its largest step: one path, one compile)
        self.counting_layout_max: int | None = None
        # inference: the permute, gate/up product and SiTU activation as one function of (z, src rows, group ends,
        # gate/up weight, betas) giving h (a CUDA engine's ``kernels.moe.triton.permute_situ_engine``, set by
        # ``model.serving``); None: the three apart
        self.permute_glu_fn: Callable | None = None
        # None: this module computes every expert; expert parallelism (kernels.moe.ep.ExpertParallel,
        # attached by rl/parallel.py) sends the slots to the ranks holding their experts instead
        self.dispatch: Callable | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's projections as nn.Linear initialises its weight, U(+-1/sqrt(fan_in)), expert by expert
        in the order gate, up, down: the random draws of 3E nn.Linear modules (``expert_weight_views``)."""
        for w in self.expert_weight_views():
            bound = w.shape[-1] ** -0.5
            nn.init.uniform_(w, -bound, bound)

    def expert_weight_views(self) -> list[torch.Tensor]:
        """Views of expert e's gate [I, Z], up [I, Z] and down [Z, I] weights, e = 0 .. E-1: the order in
        which initialisers draw, so that a seed gives the weights the per-expert modules it replaces had."""
        I = self.intermediate
        return [w for e in range(self.num_experts)
                for w in (self.gate_up_proj[e, :I], self.gate_up_proj[e, I:], self.down_proj[e])]  # fmt: skip

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, act={self.act}"

    def forward(self, z_TZ: torch.Tensor, route: RouterOutput) -> torch.Tensor:
        w_gu, w_down = self.gate_up_proj, self.down_proj
        if self.dispatch is not None:
            return self.dispatch(self, z_TZ, route, w_gu, w_down)
        if fast.pick("moe", z_TZ.device) == "grouped":
            return self._grouped(z_TZ, route, w_gu, w_down)
        return self._loop(z_TZ, route, w_gu, w_down)

    def expert(self, e: int, x: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """Expert e alone on rows x: down(act(gate x, up x)), with the weights read by ``forward``."""
        g, u = F.linear(x, w_gu[e]).chunk(2, dim=-1)
        return F.linear(self.glu(g, u), w_down[e])

    def grouped_glu(self, x_PZ: torch.Tensor, offs_E: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor):
        """Every expert on its rows of an expert-sorted row buffer (``kernels.moe.permute``, groups ending at
        ``offs_E``): the gate/up and the down projections as two grouped GEMMs. Also the local experts of
        expert parallelism (``kernels.moe.ep``)."""
        from kernels.moe import grouped_mm

        g_PI, u_PI = grouped_mm(x_PZ, w_gu, offs_E).chunk(2, dim=-1)
        return grouped_mm(self.glu(g_PI, u_PI), w_down, offs_E)

    def _grouped(self, z_TZ, route: RouterOutput, w_gu, w_down) -> torch.Tensor:
        """The grouped form of ``_loop``: same products, same (token, slot) order of the weighted fp32 sum,
        so it equals the loop up to the GEMMs' own rounding. Two autograd nodes (``kernels.moe``): the
        permute with the gate/up GEMM (keeps z, not its k-times larger permuted rows), and the activation,
        the down GEMM and the weighted sum (keep the gate/up rows only; h is recomputed in backward)."""
        from kernels.moe import (
            glu_grouped_mm_combine,
            grouped_mm_alignment,
            grouped_mm_combine,
            permute_grouped_mm,
            route_layout,
        )

        dt = compute_dtype(z_TZ)
        align = grouped_mm_alignment(z_TZ.device, dt)
        layout = route_layout(route.experts_TK, self.num_experts, align, self.route_fn, self.counting_layout_max)
        if self.permute_glu_fn is not None and self.act == "situ" and not torch.is_grad_enabled():
            h_PI = self.permute_glu_fn(z_TZ.to(dt), layout.src_row_P, layout.offs_E, w_gu.to(dt), *self.situ_betas)
            return grouped_mm_combine(h_PI, layout, w_down, route.weights_TK, z_TZ.dtype)
        # the weights go in as read (fp32 masters): cast inside, and again in backward rather than kept
        gu_PI2 = permute_grouped_mm(z_TZ.to(dt), layout, w_gu)
        glu = self._glu_rows(z_TZ)
        return glu_grouped_mm_combine(gu_PI2, layout, w_down, route.weights_TK, glu, z_TZ.dtype)

    def _glu_rows(self, z_TZ: torch.Tensor) -> GluActivation:
        """The activation ``glu_grouped_mm_combine`` runs (and reruns in backward), as ``GatedActivation.glu``
        would run it: the fused kernels where ``model.fast`` op "glu" takes them in training, else this module's
        ``glu_fn`` (the node already recomputes h, so no "recompute" wrapper) with the closed-form gradient."""
        fused = (fast.pick("glu", z_TZ.device) == "triton" and self.act == "situ" and z_TZ.is_cuda
                 and torch.is_grad_enabled())  # fmt: skip
        return GluActivation(self.act, *self.situ_betas, fused=fused, fn=self.glu_fn)

    def _loop(self, z_TZ, route: RouterOutput, w_gu, w_down) -> torch.Tensor:
        """sum_j w_tj E_{e_tj}(z_t): experts run on their tokens, results go back to (token, slot)
        order and are summed over the k slots (no scatter-add, so it is deterministic)."""
        T, k = route.experts_TK.shape
        flat_experts = route.experts_TK.reshape(-1)
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        tokens_sorted = z_TZ[order // k]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.expert(e, tokens_sorted[start : start + n], w_gu, w_down))
            start += n
        slots = torch.empty(T * k, z_TZ.shape[-1], dtype=z_TZ.dtype, device=z_TZ.device)
        slots = slots.index_put((order,), torch.cat(outs).to(z_TZ.dtype)) if outs else slots.zero_()
        weighted_TKZ = f32(slots.view(T, k, -1)) * route.weights_TK[..., None]
        return weighted_TKZ.sum(1).to(z_TZ.dtype)


# ------------------------------------------------------------------ checkpoint layout: one tensor per expert

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def expert_tensor_names(prefix: str, num_experts: int) -> list[str]:
    """The per-expert checkpoint names of one layer's experts (``prefix`` ends in "experts.")."""
    return [f"{prefix}{e}.{proj}.weight" for e in range(num_experts) for proj in ("gate_proj", "up_proj", "down_proj")]


def stack_expert_weights(named: Iterable[tuple[str, torch.Tensor]], num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Named tensors with one layer's per-expert weights (``...experts.N.gate_proj.weight`` ...) replaced
    by its two stacked ones (``...experts.gate_up_proj``, ``...experts.down_proj``), yielded once all 3E of
    that layer have passed; every other tensor passes through as it comes. A layer whose experts are
    incomplete at the end (or an expert index >= ``num_experts``) is an error naming it."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in named:
        m = _PER_EXPERT.match(name)
        if m is None:
            yield name, t
            continue
        prefix, (e, proj) = m["prefix"], _expert_key(name)
        if e >= num_experts:
            raise ValueError(f"{name}: expert {e} out of range (num_experts = {num_experts})")
        parts = pending.setdefault(prefix, {})
        if (e, proj) in parts:
            raise ValueError(f"{name} given twice")
        parts[(e, proj)] = t
        if len(parts) == 3 * num_experts:
            del pending[prefix]
            yield from _stacked(prefix, parts, num_experts)
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = [n for n in expert_tensor_names(prefix, num_experts) if _expert_key(n) not in parts]
        raise ValueError(f"{prefix}*: {len(missing)} per-expert tensors missing, e.g. {missing[:3]}")


def split_expert_weights(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``stack_expert_weights``: every stacked expert weight (``...experts.gate_up_proj``
    [E, 2I, Z], ``...experts.down_proj`` [E, Z, I]) as its per-expert checkpoint tensors (contiguous
    copies), the rest as given: the on-disk layout ``save_pretrained`` writes."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if name.endswith(".experts.gate_up_proj") and t.ndim == 3:
            prefix = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".experts.down_proj") and t.ndim == 3:
            prefix = name.removesuffix("down_proj")
            out.update({f"{prefix}{e}.down_proj.weight": w.contiguous() for e, w in enumerate(t)})
        else:
            out[name] = t
    return out


def stacked_names(names: Iterable[str]) -> list[str]:
    """``names`` with per-expert checkpoint names replaced by the stacked weights they load into (in order,
    each once): what a full update from a checkpoint directory changed in the model."""
    out: dict[str, None] = {}
    for name in names:
        m = _PER_EXPERT.match(name)
        out[name if m is None else m["prefix"] + ("down_proj" if m["proj"] == "down_proj" else "gate_up_proj")] = None
    return list(out)


def _expert_key(name: str) -> tuple[int, str]:
    m = _PER_EXPERT.match(name)
    return int(m["e"]), m["proj"]


def _stacked(prefix: str, parts: dict, num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    experts = range(num_experts)
    gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in experts]
    yield prefix + "gate_up_proj", torch.stack(gate_up)
    yield prefix + "down_proj", torch.stack([parts[(e, "down_proj")] for e in experts])


def expert_conversions() -> list:
    """transformers' conversion mapping of our checkpoints: per-expert tensors on disk, stacked in the
    model (``from_pretrained`` merges, ``save_pretrained`` splits back). Registered by ``model.modeling``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    return [
        WeightConverter(
            source_patterns=["block_sparse_moe.experts.*.gate_proj.weight", "block_sparse_moe.experts.*.up_proj.weight"],
            target_patterns="block_sparse_moe.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns=["block_sparse_moe.experts.*.down_proj.weight"],
            target_patterns="block_sparse_moe.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]


class DenseMLP(GLUMLP):
    """The first ``first_k_dense_replace`` layers' FFN (K3: one dense layer)."""

    def __init__(self, config: HybridConfig) -> None:
        betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, betas)
