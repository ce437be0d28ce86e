"""The learner: owns the policy (+ optional value head, reference copy), the optimizer and balancer.

A plain class; ``rl/train.py`` wraps it with ``ray.remote``. Per RL step it receives mini-batches of
packed micro-batches (``rl/batching.py``), accumulates gradients over the micro-batches of each
mini-batch, clips, and takes one AdamW step per mini-batch. Every step it also reports the
rollout/learner logprob mismatch on the sampled tokens (pre-update learner logprobs against the
engine's): ``mismatch/logprob_abs_mean`` and ``mismatch/kl`` (k3 estimate of KL(rollout || learner)).

Routing replay (R3): a micro-batch's ``routed_experts_TLK`` fixes the experts of every token the
engine computed, prompt and observation tokens included; tokens without a record (-1: a prefix-cache
hit from another request, an episode's never-fed last token) are routed freely by the router in the
same forward. The gate weights are always recomputed, so the router still learns.

Balancing bias: ``balancer = frozen`` (default) never changes it during RL; ``update`` recomputes it
after each optimizer step with the model's balancing rule, and the bias ships with the weights
(it is a buffer of the state dict) at the next sync.

CUDA graphs (``learner.cuda_graphs``, a single-process learner on a GPU): every compiled block (MoE, KDA and MLA
layers, LM head chunks) replays as inductor's CUDA graphs, one recorded per input shape, so every forward pads its
micro-batch to a multiple of ``learner.token_buckets``' size with one filler sequence and its sequence count to a
power of two with empty sequences (``_with_filler``), and builds a static layout (``seq_layout(static=True)``:
varlen attention's longest length is the token count, the KDA chunk plan padded to its largest size): each packed
sequence is computed apart and the routers leave the filler out of their statistics, so the batch's own logprobs,
loss and gradients are those of the unpadded batch (tests/rl/test_learner_buckets.py); each micro-batch's passes
begin a new graph step.

Deviation: with ``ppo_epochs * num_minibatches == 1`` the pre-update logprobs are taken from the
training forward itself (ratio == 1 exactly), saving a forward pass.

Sharded (``dist`` given: one rank of a learner group, rl/learner_group.py): the modules are sharded by
``rl.parallel.shard_learner`` (FSDP2) before the optimizer is built; each rank trains on its share of a
mini-batch's micro-batches (padding micro-batches, ``TrainBatch.padding``, keep the ranks' forward
counts equal and add nothing), the gradient norm is the global one, routing statistics and metrics are
merged over ranks, so every rank ends the step with the same metrics and balancer biases. Exports gather
the full weights in buckets onto rank 0; checkpoints are DCP directories (``rl.parallel.save_sharded``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels.transfer import to_device
from rl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from rl.losses import LossInputs, metric_floats, policy_loss_stats
from rl.types import TrainBatch


@dataclass
class WeightUpdate:
    """What a rollout worker needs to load the learner's weights (a directory, not tensors in RPCs)."""

    version: int
    path: str  # directory: model.safetensors (+ config.json), or adapter_model.safetensors
    adapter_only: bool = False


@dataclass
class ForwardOut:
    logprobs_T: torch.Tensor  # log p(input_ids[t] | < t), 0 at sequence starts
    entropy_T: torch.Tensor | None
    values_T: torch.Tensor | None


def build_model(cfg: ModelConfig):
    """The policy from ``init_from`` (a checkpoint directory) or a random init of ``arch``."""
    from model import HybridConfig, HybridForCausalLM

    if cfg.init_from:
        if not Path(cfg.init_from, "config.json").is_file():
            raise FileNotFoundError(
                f"model.init_from={cfg.init_from!r} has no config.json (not a checkpoint dir)"
            )
        return HybridForCausalLM.from_pretrained(cfg.init_from, torch_dtype=torch.float32)
    known = set(inspect.signature(HybridConfig.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(cfg.arch) - known)
    if unknown:
        raise ValueError(f"model.arch has unknown HybridConfig fields {unknown}")
    torch.manual_seed(cfg.seed)
    return HybridForCausalLM(HybridConfig(**cfg.arch))


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


CHECKPOINT_SCOPES = {"layer": ("attention", "ffn"), "ffn": ("ffn",), "attention": ("attention",)}


def _checkpoint_layers(model: nn.Module, scope: str = "layer") -> None:
    """Recompute each decoder layer's sub-blocks named by ``scope`` (``CHECKPOINT_SCOPES``) in backward
    instead of storing their activations: "layer" both, "ffn" only the FFN / MoE (selective: the
    attention kernels' outputs stay, the wide expert activations are recomputed)."""
    if scope not in CHECKPOINT_SCOPES:
        raise ValueError(
            f"learner.checkpoint_scope must be one of {sorted(CHECKPOINT_SCOPES)}, got {scope!r}"
        )
    for layer in model.model.layers:
        for name in CHECKPOINT_SCOPES[scope]:
            fn = getattr(layer, name)
            setattr(layer, name, functools.partial(checkpoint, fn, use_reentrant=False))


class Learner:
    def __init__(self, model_cfg: ModelConfig, cfg: LearnerConfig, algo: AlgorithmConfig, dist=None) -> None:
        from model import ExpertBalancer
        from model.fast import FastPaths

        self.cfg, self.algo = cfg, algo
        try:
            self.fast_paths = FastPaths.parse(cfg.fast_paths)
        except ValueError as e:
            raise ValueError(f"learner.fast_paths: {e}") from None
        if cfg.checkpoint_scope not in CHECKPOINT_SCOPES:
            raise ValueError(
                f"learner.checkpoint_scope must be one of {sorted(CHECKPOINT_SCOPES)}, got {cfg.checkpoint_scope!r}"
            )
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        self.device = _device(cfg.device)
        self.policy = build_model(model_cfg).to(self.device)
        self.base_model = self.policy
        self.balancer = None
        if self.policy.config.num_experts > 0:
            mode = "frozen" if cfg.balancer == "frozen" else None  # None: the model's own rule
            self.balancer = ExpertBalancer(self.policy, mode=mode)
        self.reference = None
        if algo.kl_coef > 0 and not cfg.lora.enabled:
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if cfg.lora.enabled:
            self.policy = self._wrap_lora(self.policy)
        if cfg.activation_checkpointing:
            _checkpoint_layers(self.base_model, cfg.checkpoint_scope)
        self.compiled_regions = []
        if cfg.compile:  # after the reference copy: no-grad reference passes stay eager
            from model.compile import compile_regions, resolve_compile_scope

            scope = resolve_compile_scope(cfg.compile_scope, self.device, on_cuda="blocks")
            self.compiled_regions = compile_regions(self.base_model, scope=scope, cuda_graphs=self._graphs(scope, dist))
        self.bucket_tokens = bucket_tokens(cfg)
        hidden = self.base_model.config.hidden_size
        self.value_head = nn.Linear(hidden, 1).to(self.device) if (algo.vf_coef or 0) > 0 else None
        self.dist = dist  # rl.parallel.Distributed, or None: a plain single-process learner
        if dist is not None:
            from rl.parallel import shard_learner

            shard_learner(self, dist)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
            fused=fused_adamw(self.device, dist),
        )  # fmt: skip
        self.step_count = 0
        self.version = 0

    # ------------------------------------------------------------------ setup helpers
    def _graphs(self, scope: str, dist) -> str | bool:
        """What ``compile_regions`` replays as CUDA graphs with ``learner.cuda_graphs``: every compiled block of
        the scope (the micro-batches' layouts are static: ``_with_filler``'s buckets, ``seq_layout(static=True)``)."""
        if not self.cfg.cuda_graphs:
            return False
        if self.device.type != "cuda" or dist is not None or scope == "regions":
            raise ValueError(
                "learner.cuda_graphs needs the single-process learner on a CUDA device with compiled MoE blocks "
                f"(compile_scope moe, blocks or auto), got device {self.device}, "
                f"{'a sharded learner' if dist is not None else 'one process'}, compile scope {scope!r}"
            )
        return True

    @property
    def static_layout(self) -> bool:
        """With CUDA graphs every compiled layer replays, so its shapes follow the token and sequence buckets alone
        (``_with_filler``'s, ``model.layers.seq_layout(static=True)``)."""
        return bool(self.cfg.cuda_graphs)

    def _new_graph_step(self) -> None:
        """Before each micro-batch's passes under ``learner.cuda_graphs``: the previous ones' graph outputs are done
        with (inductor's cudagraph trees overwrite them on the next replay)."""
        if self.cfg.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def _wrap_lora(self, model):
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lc = self.cfg.lora
        targets = lc.target_modules[0] if lc.target_modules == ["all-linear"] else list(lc.target_modules)
        peft_cfg = PeftLoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=targets,
            target_parameters=list(lc.target_parameters) or None,
        )
        return get_peft_model(model, peft_cfg)

    def _paths(self):
        """``model.fast`` choice of this learner, around forwards and backwards alike (a checkpointed
        region recomputed in backward must take the path its forward took)."""
        from model.fast import use_fast_paths

        return use_fast_paths(self.fast_paths)

    def _autocast(self):
        if self.cfg.dtype == "bfloat16" and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _lr_scale(self) -> float:
        w = self.cfg.warmup_steps
        return min(1.0, (self.step_count + 1) / w) if w > 0 else 1.0

    # ------------------------------------------------------------------ forward
    def forward(self, batch: TrainBatch, model=None, need_entropy: bool = False) -> ForwardOut:
        """Learner logprobs of every token given its prefix (per packed sequence), entropy, values.

        cu_seqlens and the replayed routes go to the model as the batch's host tensors, so the model
        builds its sequence layout and checks the routes without a device sync. The LM head is the
        chunked one (no [T, V] logits, entropy from the same chunks) where ``model.fast`` picks it."""
        from model.fast import pick

        model = model if model is not None else self.policy
        T = batch.num_tokens
        ids_host, cu_host, routes, filler = _with_filler(
            batch, self.bucket_tokens, self.cfg.routing_replay, seqs_pow2=self.static_layout
        )
        ids_1T = to_device(ids_host, self.device)[None]
        cu = to_device(batch.cu_seqlens_N1, self.device)
        targets_1T = torch.roll(ids_1T, -1, dims=1)
        with self._paths():
            plain = pick("lm_head", self.device) == "plain"
        with self._paths(), self._autocast():
            out = model(
                ids_1T, cu_seqlens=cu_host, routed_experts=routes, target_ids=targets_1T,
                return_logits=plain, return_entropy=need_entropy and not plain, filler_tokens=filler,
                static_layout=self.static_layout,
            )  # fmt: skip
        # the batch's own tokens (the filler sequence, if any, comes after them)
        own = {k: None if getattr(out, k) is None else getattr(out, k)[0, :T]
               for k in ("token_logprobs", "entropy", "logits", "hidden_states")}  # fmt: skip
        logprobs_T = torch.zeros(T, device=self.device, dtype=torch.float32)
        logprobs_T = torch.cat([logprobs_T[:1], own["token_logprobs"][:-1]])
        # index_fill_, not ``starts[idx] = True``: that copies the True to the device from pageable memory, a
        # host sync in the middle of the forward (torch.cuda.set_sync_debug_mode, bench/learner_mfu.py)
        starts = torch.zeros_like(logprobs_T, dtype=torch.bool).index_fill_(0, cu[:-1].long(), True)
        logprobs_T = torch.where(starts, torch.zeros_like(logprobs_T), logprobs_T)
        entropy_T = None
        if need_entropy and not plain:  # from the head's chunks; a gradient only for an entropy term
            ent_T = own["entropy"] if self.algo.entropy_coef > 0 else own["entropy"].detach()
            entropy_T = torch.cat([ent_T[:1], ent_T[:-1]])
        elif need_entropy:  # with grad only when the loss has an entropy term (it costs a [T, V] softmax)
            with contextlib.nullcontext() if self.algo.entropy_coef > 0 else torch.no_grad():
                logits_TV = torch.cat([own["logits"][:1], own["logits"][:-1]]).float()
                entropy_T = logits_TV.logsumexp(-1) - (logits_TV.softmax(-1) * logits_TV).sum(-1)
        values_T = (
            self.value_head(own["hidden_states"].float())[:, 0] if self.value_head is not None else None
        )
        return ForwardOut(logprobs_T, entropy_T, values_T)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Learner logprobs [T] without gradient (eval mode): parity checks and diagnostics."""
        self.policy.eval()
        self._new_graph_step()
        return self.forward(batch).logprobs_T.cpu()

    @torch.no_grad()
    def turn_values(self, batch: TrainBatch) -> list[list[float]]:
        """Value head at each turn boundary, per sequence: the V_k of turn-level GAE."""
        if self.value_head is None:
            raise ValueError("turn_values needs a value head (algorithm.vf_coef > 0)")
        self.policy.eval()
        self._new_graph_step()
        values_T = self.forward(batch).values_T.cpu()
        return [values_T[(batch.seq_ids_T == i) & batch.value_mask_T].tolist() for i in range(batch.num_seqs)]

    # ------------------------------------------------------------------ RL step
    def _loss_inputs(self, mb: TrainBatch, fwd: ForwardOut, old_T, old_values_T) -> LossInputs:
        dev = self.device
        ref_T = None
        if self.algo.kl_coef > 0:
            ref_model = self.reference
            ctx = self.policy.disable_adapter() if self.cfg.lora.enabled else contextlib.nullcontext()
            with torch.no_grad(), ctx:
                ref_T = self.forward(mb, model=ref_model if ref_model is not None else self.policy).logprobs_T
        return LossInputs(
            logprobs_T=fwd.logprobs_T, old_logprobs_T=old_T, rollout_logprobs_T=to_device(mb.rollout_logprobs_T, dev),
            advantages_T=to_device(mb.advantages_T, dev), token_weights_T=to_device(mb.token_weights_T, dev),
            loss_mask_T=to_device(mb.loss_mask_T, dev), seq_ids_T=to_device(mb.seq_ids_T, dev), ref_logprobs_T=ref_T,
            entropy_T=fwd.entropy_T, values_T=fwd.values_T, old_values_T=old_values_T,
            value_targets_T=to_device(mb.value_targets_T, dev), value_weights_T=to_device(mb.value_weights_T, dev),
            num_seqs=mb.num_seqs,
        )  # fmt: skip

    @torch.no_grad()
    def _pre_update(self, minibatches: list[list[TrainBatch]]) -> dict:
        """Pre-update logprobs/values of every micro-batch, needed when there are several updates."""
        self.policy.eval()
        out = {}
        for i, mb in enumerate(minibatches):
            for j, micro in enumerate(mb):
                self._new_graph_step()
                f = self.forward(micro)
                out[i, j] = (f.logprobs_T, f.values_T)
        return out

    def train_step(self, minibatches: list[list[TrainBatch]]) -> dict[str, float]:
        """One RL step: ppo_epochs x mini-batches optimizer updates; returns averaged metrics."""
        updates = self.algo.ppo_epochs * len(minibatches)
        pre = self._pre_update(minibatches) if updates > 1 else None
        # on the device until every update is queued: one read at the end, not a sync (and an idle GPU while the
        # host prepares the next update) after each optimizer step
        totals: dict[str, torch.Tensor] = {}
        mismatch = _MismatchMeter()
        for epoch in range(self.algo.ppo_epochs):
            for i, mb in enumerate(minibatches):
                m = self._update(mb, i, pre, mismatch if epoch == 0 else None)
                _accumulate(totals, m, updates)
        metrics = self._reduced(metric_floats(totals))
        metrics.update(mismatch.result(self.dist))
        if self.balancer is not None:
            metrics.update(self.balancer.summarize(self._balancer_step()))
        self.version += 1
        metrics["learner/version"] = float(self.version)
        return metrics

    def _update(self, micro_batches: list[TrainBatch], i: int, pre, mismatch) -> dict[str, torch.Tensor]:
        """One optimizer update over ``micro_batches``; its metrics as 0-dim device tensors."""
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        need_entropy = True
        sums: dict[str, torch.Tensor] = {}  # on the device: read back once, after the optimizer step
        for j, micro in enumerate(micro_batches):
            self._new_graph_step()
            if micro.padding:
                self._padding_backward(micro, need_entropy)
                continue
            fwd = self.forward(micro, need_entropy=need_entropy)
            old_T, old_v = pre[i, j] if pre is not None else (fwd.logprobs_T.detach(), None)
            if fwd.values_T is not None and old_v is None:
                old_v = fwd.values_T.detach()
            if mismatch is not None:
                mismatch.add(
                    old_T,
                    to_device(micro.rollout_logprobs_T, self.device),
                    to_device(micro.loss_mask_T, self.device),
                )
            loss, m = policy_loss_stats(self._loss_inputs(micro, fwd, old_T, old_v), self.algo)
            with self._paths():
                loss.backward()
            for k, v in m.items():
                if k not in sums:
                    sums[k] = v
                else:
                    sums[k] = torch.maximum(sums[k], v) if k.endswith("_max") else sums[k] + v
        sums["grad_norm"] = self._clip_and_step()
        return sums

    def _padding_backward(self, micro: TrainBatch, need_entropy: bool = False) -> None:
        """A padding micro-batch's forward and backward: its zero loss weights add exact zeros to every
        gradient, no metric and no routing statistic; it only makes the rank join the group's gathers."""
        from rl.parallel import routing_stats_untouched

        gates = self.balancer.gates if self.balancer is not None else []
        with routing_stats_untouched(gates):
            fwd = self.forward(micro, need_entropy=need_entropy)
            old_T = fwd.logprobs_T.detach()
            old_v = fwd.values_T.detach() if fwd.values_T is not None else None
            loss, _ = policy_loss_stats(self._loss_inputs(micro, fwd, old_T, old_v), self.algo)
            with self._paths():
                loss.backward()

    def _reduced(self, metrics: dict[str, float]) -> dict[str, float]:
        from rl.parallel import reduce_metrics

        return reduce_metrics(metrics, self.dist, same=("grad_norm",)) if self.dist is not None else metrics

    def _balancer_step(self):
        from rl.parallel import merge_routing_stats

        merge_routing_stats(self.balancer.gates, self.dist)
        return self.balancer.step()

    def _clip_and_step(self) -> torch.Tensor:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.dist is not None:
            from rl.parallel import clip_grad_norm_

            norm = clip_grad_norm_(params, self.cfg.grad_clip)
        elif all(g.get("fused") for g in self.optimizer.param_groups):
            norm = self._clip_in_step(params)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr * self._lr_scale()
        self.optimizer.step()
        self.step_count += 1
        return norm

    def _clip_in_step(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Gradient clipping inside a fused AdamW step: the total norm as ``clip_grad_norm_`` takes it, and the fused
        kernel divides each gradient by max(1, (norm + 1e-6) / grad_clip) as it reads it (its ``grad_scale``, the
        attribute torch's GradScaler sets) instead of a pass of its own over every gradient (2.8 ms of gpu_1b's step
        on an H200). The same update up to the rounding of a division against a multiplication."""
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        self.optimizer.grad_scale = ((norm + 1e-6) / self.cfg.grad_clip).clamp(min=1.0).float()
        return norm

    # ------------------------------------------------------------------ SFT step
    def sft_step(self, micro_batches: list[TrainBatch]) -> dict[str, float]:
        """Next-token cross-entropy on the loss-masked (assistant) tokens, weights from ``token_weights``."""
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        nll, correct = 0.0, 0.0
        for micro in micro_batches:
            from rl.parallel import routing_stats_untouched

            gates = self.balancer.gates if self.balancer is not None and micro.padding else []
            self._new_graph_step()
            with routing_stats_untouched(gates) if micro.padding else contextlib.nullcontext():
                fwd = self.forward(micro)
                w_T = micro.token_weights_T.to(self.device)
                loss = -(w_T * fwd.logprobs_T).sum()
                with self._paths():
                    loss.backward()
            nll += float(loss.detach())
            correct += float((w_T * (fwd.logprobs_T.detach() > np.log(0.5)).float()).sum())
        norm = self._clip_and_step()
        if self.balancer is not None:
            self._balancer_step()
        self.version += 1
        sums = self._reduced({"sft/nll": nll, "sft/p_gt_half": correct})
        return {**sums, "sft/grad_norm": float(norm)}

    # ------------------------------------------------------------------ weights and checkpoints
    def export_weights(self, out_dir: str, keep: int = 2, adapter_only: bool | None = None) -> WeightUpdate:
        """Write the current weights for the rollout workers, tagged with the policy version.

        Full weights go out as an HF checkpoint (config.json + model.safetensors, balancer biases
        included as buffers). With LoRA, ``adapter_only`` (default: ``lora.sync == "adapter"``) writes
        only the adapter (adapter_model.safetensors); otherwise the adapters are merged into a full
        checkpoint, for engines that cannot apply adapters.
        """
        path = Path(out_dir) / f"v{self.version:06d}"
        path.mkdir(parents=True, exist_ok=True)
        lora = self.cfg.lora.enabled
        adapter_only = lora and (self.cfg.lora.sync == "adapter" if adapter_only is None else adapter_only)
        if self.dist is not None:
            self._write_gathered(path, "adapter" if adapter_only else "full")
        elif adapter_only:
            self.policy.save_pretrained(str(path))
        elif lora:
            self._save_merged(path)
        else:
            self.base_model.save_pretrained(str(path), safe_serialization=True)
        (path / "version.json").write_text(json.dumps({"version": self.version}))
        for old in sorted(Path(out_dir).glob("v[0-9]*"))[:-keep]:  # workers only ever read the newest
            shutil.rmtree(old, ignore_errors=True)
        return WeightUpdate(self.version, str(path), adapter_only)

    def export_base_weights(self, out_dir: str) -> WeightUpdate:
        """The frozen base weights without adapters, as a full checkpoint in ``out_dir`` (never pruned):
        what rollout workers start from (and restart from) with adapter-only sync."""
        if not self.cfg.lora.enabled:
            raise ValueError("export_base_weights is for LoRA training (learner.lora.enabled)")
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        if self.dist is not None:
            self._write_gathered(path, "base")
        else:
            self._save_merged(path, merge=False)
        return WeightUpdate(self.version, str(path), adapter_only=False)

    def weight_buckets(self, kind: str = "full", bucket_bytes: int | None = None, device=None):
        """The weights the rollout engines load, as buckets of whole CPU tensors under the engines'
        names (``rl.parallel.full_tensors``): ``full`` (adapters merged in with LoRA), ``base`` (LoRA's
        frozen base) or ``adapter`` (LoRA tensors only, peft's save names). A generator every rank of a
        group must drain (the gathers are collective); only rank 0 gets buckets. ``device``: where a
        model without LoRA puts its copies (the ipc and, under NCCL, the nccl transport: the learner's
        GPU, no round trip through the host; the values are the same); LoRA's tensors stay on the host, where the merge is computed
        for every transport alike."""
        from rl.parallel import DEFAULT_BUCKET_BYTES, full_tensors

        size = bucket_bytes or DEFAULT_BUCKET_BYTES
        tied = self.base_model.config.tie_word_embeddings
        if not self.cfg.lora.enabled:
            if kind != "full":
                raise ValueError(f"weight_buckets({kind!r}) is for LoRA training (learner.lora.enabled)")
            keep = lambda n: not (tied and n == "lm_head.weight")
            yield from full_tensors(self.base_model, self.dist, size, keep, device or "cpu")
            return
        if kind == "adapter":
            for bucket in full_tensors(self.policy, self.dist, size, lambda n: "lora_" in n):
                yield {k.replace(".default", ""): v for k, v in bucket.items()}
            return
        yield from _merged_buckets(self.policy, self.dist, size, merge=kind == "full", tied=tied)

    def policy_version(self) -> int:
        return self.version

    def drain_weight_buckets(self, kind: str = "full", bucket_bytes: int | None = None) -> int:
        """Join a gather without receiving it (a group's ranks other than 0); returns the bucket count."""
        return sum(1 for _ in self.weight_buckets(kind, bucket_bytes))

    def adapter_scale_fields(self) -> dict:
        """r, alpha and rsLoRA of the adapters: what ``rollout.adapters.AdapterWeights`` needs beside them."""
        lc = self.cfg.lora
        return {"r": lc.r, "alpha": float(lc.alpha), "use_rslora": False}

    # ------------------------------------------------------------------ the nccl weight sync's sending end
    # (rank 0 only; rl/weight_sync.py drives these and keeps the group's state in this process)
    def weight_device(self) -> dict:
        from rollout.weight_broadcast import device_record

        return device_record(self.device)

    def open_weight_group(
        self, name: str, world_size: int, backend: str, timeout_s: float
    ) -> tuple[str, int]:
        from rl.weight_sync import open_sender

        return open_sender(name, world_size, backend, timeout_s, self.device)

    def join_weight_group(self, name: str) -> None:
        from rl.weight_sync import join_sender

        join_sender(name)

    def broadcast_weight_buckets(self, name: str, kind: str = "full", bucket_bytes: int | None = None):
        """``weight_buckets(kind)`` broadcast over group ``name``, yielding each bucket's metadata first; the
        copies are gathered where the group broadcasts from (this GPU under NCCL: no round trip through the
        host; LoRA's stay on the host, see ``weight_buckets``)."""
        from rl.weight_sync import broadcast_buckets, sender_device

        yield from broadcast_buckets(name, self.weight_buckets(kind, bucket_bytes, sender_device(name)), kind)

    def close_weight_group(self, name: str) -> None:
        from rl.weight_sync import close_sender

        close_sender(name)

    # ------------------------------------------------------------------ the ipc weight sync's sending end
    # (rank 0 only; rl/weight_sync.py steps the stream bucket by bucket and keeps it in this process)
    def open_weight_ipc(self, name: str, kind: str = "full", bucket_bytes: int | None = None) -> None:
        from rl.weight_sync import open_ipc_stream

        open_ipc_stream(name, self.weight_buckets(kind, bucket_bytes, self.device), kind, self.device)

    def next_weight_ipc(self, name: str, acked: int):
        """Free the buckets up to ``acked`` (loaded by every worker), share the next one (None: done)."""
        from rl.weight_sync import next_ipc_bucket

        return next_ipc_bucket(name, acked)

    def close_weight_ipc(self, name: str) -> int:
        from rl.weight_sync import close_ipc_stream

        return close_ipc_stream(name)

    def _write_gathered(self, path: Path, kind: str) -> None:
        """``weight_buckets(kind)`` written by rank 0: an HF sharded checkpoint (config.json + shards) or,
        for ``adapter``, a peft-style adapter directory; every rank joins the gathers."""
        from rl.parallel import write_sharded_safetensors

        buckets = self.weight_buckets(kind)
        if kind == "adapter":
            tensors = {k: v for b in buckets for k, v in b.items()}  # adapters: a few MB
            if self.dist.is_main:
                from rollout.adapters import AdapterWeights

                AdapterWeights(tensors, **self.adapter_scale_fields()).save(path)
            return
        write_sharded_safetensors(buckets, path)
        if self.dist.is_main:
            from model import HybridForCausalLM

            config = copy.deepcopy(self.base_model.config)
            config.architectures = [HybridForCausalLM.__name__]  # the class FSDP wrapped (vLLM needs it)
            config.save_pretrained(str(path))

    @torch.no_grad()
    def _save_merged(self, path: Path, merge: bool = True) -> None:
        """W + scale * B A for every adapted layer (W alone without ``merge``), written under the plain
        (un-wrapped) parameter names. Out of place: peft's merge_adapter + unmerge_adapter would leave
        W + d - d, which is not W in floating point, so the frozen base would drift at every sync."""
        from peft.tuners.lora import LoraLayer
        from safetensors.torch import save_file

        from model.moe import split_expert_weights

        model = self.policy.get_base_model()
        state = {
            k.replace(".base_layer", ""): v.detach().clone().contiguous()
            for k, v in model.state_dict().items()
            if "lora_" not in k
        }
        for name, module in model.named_modules() if merge else ():
            if isinstance(module, LoraLayer):
                key = lora_weight_name(name, module)
                for adapter in module.active_adapters:  # the order and arithmetic of peft's merge
                    state[key] += module.get_delta_weight(adapter).to(state[key].dtype)
        if self.base_model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        self.base_model.config.save_pretrained(str(path))
        save_file(split_expert_weights(state), str(path / "model.safetensors"), metadata={"format": "pt"})

    def save_pretrained(self, out_dir: str) -> str:
        """A standalone HF checkpoint of the (merged, if LoRA) policy: what ``model.init_from`` loads.
        Out of place: with LoRA the policy keeps its adapters, so the optimizer and training go on."""
        if self.dist is not None:
            self._write_gathered(Path(out_dir), "full")
        elif self.cfg.lora.enabled:
            self._save_merged(Path(out_dir))
        else:
            self.base_model.save_pretrained(out_dir, safe_serialization=True)
        return out_dir

    def state_dict(self) -> dict:
        """Everything exact resume needs from the learner: weights, optimizer, balancer, RNG, counters."""
        return {
            "policy": self.policy.state_dict(),
            "value_head": self.value_head.state_dict() if self.value_head is not None else None,
            "optimizer": self.optimizer.state_dict(),
            **self.host_state(),
        }

    def host_state(self) -> dict:
        """The state beside weights and optimizer: balancer, counters, RNG (per rank in a group)."""
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available() and self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"balancer": self.balancer.state_dict() if self.balancer is not None else None,
                "step_count": self.step_count, "version": self.version, "rng": rng}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        if self.value_head is not None and state["value_head"] is not None:
            self.value_head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(state["optimizer"])
        kernels = {k: v for k, v in self.optimizer.defaults.items() if k in ("fused", "foreach")}
        for g in self.optimizer.param_groups:  # the kernels are this learner's choice, not the saving machine's
            g.update(kernels)
        self.load_host_state(state)

    def load_host_state(self, state: dict) -> None:
        if self.balancer is not None and state["balancer"] is not None:
            self.balancer.load_state_dict(state["balancer"])
        self.step_count, self.version = state["step_count"], state["version"]
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def save(self, path: str) -> None:
        """``path``: a file (``torch.save``) or, sharded, a DCP directory every rank writes its shards to."""
        if self.dist is not None:
            from rl.parallel import save_sharded

            save_sharded(self, path)
        else:
            torch.save(self.state_dict(), path)

    def load(self, path: str) -> None:
        if self.dist is not None:
            from rl.parallel import load_sharded

            load_sharded(self, path)
        else:
            self.load_state_dict(torch.load(path, weights_only=False))


def fused_adamw(device: torch.device, dist) -> bool | None:
    """AdamW's ``fused``: True for a single-process learner on CUDA (the fp32 master weights, gradients and moments
    in one multi-tensor kernel: what bench/learner_mfu.py has timed, 10 ms of gpu_1b's step on an H200), None
    (torch's default, foreach) elsewhere: on CPU, and for the sharded learner (its DTensor parameters were never
    run fused)."""
    return True if device.type == "cuda" and dist is None else None


def bucket_tokens(cfg: LearnerConfig) -> int:
    """The size every micro-batch is padded to a multiple of: micro_batch_tokens / token_buckets (8 buckets with
    cuda_graphs when unset), rounded up; 0: micro-batches unpadded."""
    buckets = cfg.token_buckets or (8 if cfg.cuda_graphs else 0)
    return -(-cfg.micro_batch_tokens // buckets) if buckets else 0


def _with_filler(batch: TrainBatch, bucket: int, replay: bool, seqs_pow2: bool = False):
    """(input ids, host cu_seqlens, routes or None, filler tokens) of ``batch`` padded up to a multiple of
    ``bucket`` tokens (0: as it is) with one filler sequence of token 0, routed freely: the routes stay the batch's
    own rows, the model adds the filler's -1 rows on the device (``filler_tokens``; no host copy of the table).
    Each packed sequence is computed apart, so the batch's own tokens come out as without the filler.
    ``seqs_pow2``: empty sequences appended up to a power of two of sequences (a static layout's sequence bucket)."""
    routes = batch.routed_experts_TLK if replay else None  # -1 rows: tokens routed freely in the same forward
    T = batch.num_tokens
    filler = -(-T // bucket) * bucket - T if bucket else 0
    ids, cu = batch.input_ids_T, batch.cu_seqlens_N1
    if filler:
        ids = torch.cat([ids, ids.new_zeros(filler)])
        cu = torch.cat([cu, cu.new_full((1,), T + filler)])
    if seqs_pow2:
        n = len(cu) - 1
        cu = torch.cat([cu, cu.new_full((next_pow2(n) - n,), T + filler)])
    return ids, cu, routes, filler


def _accumulate(totals: dict[str, torch.Tensor], update: dict[str, torch.Tensor], updates: int) -> None:
    """Adds one of a step's ``updates`` updates' metrics into ``totals`` on the device, in float64: "_max" metrics
    by maximum, the others divided by ``updates`` (their mean over the step's updates)."""
    for k, v in update.items():
        v = v.double()
        if k.endswith("_max"):
            totals[k] = torch.maximum(totals[k], v) if k in totals else v
        else:
            totals[k] = totals[k] + v / updates if k in totals else v / updates


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _MismatchMeter:
    """|logp_learner - logp_rollout| and k3 KL(rollout || learner) over sampled tokens."""

    def __init__(self) -> None:
        self.abs_sum = self.kl_sum = self.n = 0.0
        self.abs_max = 0.0
        self._sums_4: torch.Tensor | None = None  # abs sum, kl sum, tokens, abs max: on the device until read

    def add(self, learner_T: torch.Tensor, rollout_T: torch.Tensor, mask_T: torch.Tensor) -> None:
        """Device ops only (masked, not indexed): no host sync between a micro-batch's forward and backward."""
        d_T = torch.where(mask_T, learner_T.detach().float() - rollout_T.float(), 0.0)
        abs_T = d_T.abs()
        part_4 = torch.stack(
            [abs_T.sum(), (torch.exp(d_T) - d_T - 1).sum(), mask_T.sum().float(), abs_T.max()]
        )
        if self._sums_4 is None:
            self._sums_4 = part_4
        else:
            self._sums_4 = torch.cat(
                [self._sums_4[:3] + part_4[:3], torch.maximum(self._sums_4[3:], part_4[3:])]
            )

    def _read(self) -> None:
        if self._sums_4 is not None:
            abs_sum, kl_sum, n, abs_max = self._sums_4.tolist()
            self.abs_sum, self.kl_sum, self.n = self.abs_sum + abs_sum, self.kl_sum + kl_sum, self.n + int(n)
            self.abs_max = max(self.abs_max, abs_max)
            self._sums_4 = None

    def result(self, dist=None) -> dict[str, float]:
        """The step's values; with ``dist`` (a learner group) over every rank's tokens."""
        self._read()
        if dist is not None:
            from rl.parallel import gather_objects

            parts = gather_objects((self.abs_sum, self.kl_sum, self.n, self.abs_max), dist)
            self.abs_sum, self.kl_sum, self.n = (sum(p[i] for p in parts) for i in range(3))
            self.abs_max = max(p[3] for p in parts)
        n = max(self.n, 1)
        return {"mismatch/logprob_abs_mean": self.abs_sum / n, "mismatch/logprob_abs_max": self.abs_max,
                "mismatch/kl": self.kl_sum / n, "mismatch/tokens": self.n}  # fmt: skip


def lora_weight_name(path: str, module) -> str:
    """The plain name of the weight a peft LoRA layer at ``path`` adapts: ``<path>.weight`` of an nn.Linear,
    ``<owner>.<parameter>`` of a ``ParamWrapper`` (``target_parameters``: the routed experts' stacked
    weights; peft nests one wrapper per parameter, ``experts``, ``experts.base_layer``, ...)."""
    parameter = getattr(module, "parameter_name", None)
    if parameter is None:
        return f"{path}.weight"
    return f"{path.replace('.base_layer', '')}.{parameter}"


def _merged_buckets(policy, dist, bucket_bytes: int, merge: bool, tied: bool):
    """A LoRA policy's engine weights in buckets: ``W + delta * scale`` per adapted weight (``W`` alone
    without ``merge``), under the plain names, in the arithmetic of the engine's adapter fold
    (``rollout.adapters.AdapterTarget``: ``B @ A`` for an nn.Linear, one product per expert for the stacked
    experts), out of place as ``_save_merged``. A base weight waits for its two adapter tensors, which
    follow it in state-dict order."""
    from peft.tuners.lora import LoraLayer

    from rl.parallel import full_tensors
    from rollout.adapters import AdapterTarget

    model = policy.get_base_model()
    adapted: dict[str, tuple[float, int]] = {}  # plain weight name -> (scale, experts; 0 for a Linear)
    weight_of: dict[str, str] = {}  # wrapper module path -> the plain weight name its lora_A/B adapt
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            weight_of[name] = key = lora_weight_name(name, m)
            for a in m.active_adapters:
                adapted[key] = (m.scaling[a], m.num_experts if hasattr(m, "parameter_name") else 0)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for bucket in full_tensors(model, dist, bucket_bytes):
        out = {}
        for key, t in bucket.items():
            is_adapter = ".lora_A." in key or ".lora_B." in key
            plain = weight_of[key.split(".lora_")[0]] if is_adapter else key.replace(".base_layer", "")
            if plain not in adapted:
                if not (tied and plain == "lm_head.weight"):
                    out[plain] = t  # not adapted (a bias of an adapted Linear included)
                continue
            parts = pending.setdefault(plain, {})
            parts["W" if not is_adapter else ("A" if ".lora_A." in key else "B")] = t
            if {"W", "A", "B"} <= set(parts):
                done = pending.pop(plain)
                W = done["W"]
                if merge:
                    scale, experts = adapted[plain]
                    delta = AdapterTarget(plain, done["A"], done["B"], experts).delta(scale, W.device)
                    W = W + delta.to(W.dtype)
                out[plain] = W
        if out:
            yield out
