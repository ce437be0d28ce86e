"""Aten ops per layer kind, forward + backward, counted on the CPU: the launches a GPU step pays, without a GPU.

A ``TorchDispatchMode`` (below autograd) counts every aten op that reaches a kernel during one forward
and backward of a layer: the forward, the recomputation of checkpointed regions ("recompute" fast
paths) and the backward. Views and other metadata-only ops (view, expand, transpose, slice, detach,
empty, ...) launch nothing and are left out. The layers are the first of each kind of a model with the
preset's structure (layer pattern, 128 experts top-8, shared expert, latent MoE, AttnRes blocks) at
tiny widths: the counts do not depend on the widths, they do on the structure. Inputs are packed
varlen sequences (lengths 1, 15, 64, 65, 300 by default), captured from one model forward.

The CPU takes its own paths where the GPU's do not run (``model.fast`` "auto" on the CPU: attention
``loop``, one SDPA per sequence; conv ``torch``; GLU ``recompute`` instead of the fused Triton kernel):
compare counts per kind between commits, not with a GPU profile. ``F.rms_norm``, op by op on the CPU,
is counted as CUDA runs it (``aten._fused_rms_norm``, one kernel each way; ``--cpu-rms-norm``: as the
CPU runs it). ``--bf16`` runs under CPU bf16 autocast, which shows the dtype casts a
GPU step pays (KDA is left out there: its chunked CPU core has no bf16 triangular solve).

    python bench/op_counts.py [--bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "slice", "select", "unsqueeze",
    "squeeze", "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "_reshape_alias", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "unsafe_split", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "view_as",
    "diagonal", "unfold", "movedim", "set_", "resize_", "_to_copy_view",
}  # fmt: skip

# tiny widths, the structure of the preset kept (what op counts depend on)
TINY_WIDTHS = {
    "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
    "intermediate_size": 128,
}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts the aten ops (by overload packet name) that launch a kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_fwd_bwd(fn, inputs: list[torch.Tensor], params: list[torch.Tensor]) -> OpCounter:
    """Ops of ``fn()`` (a tensor, or a tuple whose first item is one) and of its backward to inputs and params."""
    leaves = [t for t in [*inputs, *params] if t.requires_grad]
    with OpCounter() as counter:
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        grad = torch.ones_like(out)
        torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return counter


def tiny_preset(preset: Path) -> dict:
    import yaml

    arch = yaml.safe_load(preset.read_text())
    arch = arch.get("model", arch)
    lac = dict(arch["linear_attn_config"], head_dim=16, num_heads=2)
    return {**arch, **TINY_WIDTHS, "linear_attn_config": lac}


class _FusedRMSNorm(torch.autograd.Function):
    """F.rms_norm counted as CUDA runs it: one ``_fused_rms_norm`` forward, one backward (the CPU's op-by-op
    composite computes the values, uncounted)."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps, real):
        ctx.real, ctx.args = real, (normalized_shape, eps)
        ctx.save_for_backward(x, weight)
        _count("_fused_rms_norm")
        with _uncounted():
            return real(x, normalized_shape, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        _count("_fused_rms_norm_backward")
        with _uncounted(), torch.enable_grad():
            xs = [t.detach().requires_grad_() for t in (x, weight) if t is not None]
            out = ctx.real(xs[0], ctx.args[0], xs[1] if weight is not None else None, ctx.args[1])
            grads = torch.autograd.grad(out, xs, g)
        return grads[0], grads[1] if weight is not None else None, None, None, None


_ACTIVE: list[OpCounter] = []


def _count(name: str) -> None:
    if _ACTIVE:
        _ACTIVE[-1].ops[name] += 1


@contextlib.contextmanager
def _uncounted():
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


@contextlib.contextmanager
def fused_rms_norm():
    """F.rms_norm counted as one kernel each way, as CUDA dispatches it (``aten._fused_rms_norm``)."""
    real = torch.nn.functional.rms_norm

    def fused(x, normalized_shape, weight=None, eps=None):
        return _FusedRMSNorm.apply(x, weight, tuple(normalized_shape), eps, real)

    torch.nn.functional.rms_norm = fused
    try:
        yield
    finally:
        torch.nn.functional.rms_norm = real


def layer_op_counts(
    arch: dict, lengths: list[int], bf16: bool = False, cuda_rms_norm: bool = True
) -> dict[str, dict]:
    """{kind: {"total": n, "ops": {op: count}}} for the first layer of each kind, fwd + bwd, and for the
    whole model ("model": forward with token logprobs, backward to every weight)."""
    with fused_rms_norm() if cuda_rms_norm else contextlib.nullcontext():
        return _layer_op_counts(arch, lengths, bf16)


def _layer_op_counts(arch: dict, lengths: list[int], bf16: bool) -> dict[str, dict]:
    from model import HybridConfig, fast
    from model.attnres import AttnResMix
    from model.capture import first_calls
    from model.fast import use_fast_paths
    from model.kda import KimiDeltaAttention
    from model.mla import GatedMLA
    from model.modeling import HybridForCausalLM
    from model.moe import DenseMLP, SparseMoE

    torch.manual_seed(0)
    model = HybridForCausalLM(HybridConfig(**arch)).train()
    kinds = {GatedMLA: "mla", SparseMoE: "moe", DenseMLP: "dense_mlp", AttnResMix: "attn_res"}
    if not bf16:
        kinds[KimiDeltaAttention] = "kda"
    norm: dict[str, tuple | None] = {"norm": None}
    norm_hook = model.model.norm.register_forward_pre_hook(
        lambda mod, args, kwargs: norm.__setitem__("norm", (mod, args, kwargs)), with_kwargs=True)  # fmt: skip
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.randint(0, arch["vocab_size"], (1, T))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    try:
        kda_fp32 = _kda_core_fp32() if bf16 else contextlib.nullcontext()
        # each mix and norm called as its module (the default fuses a mix with the norm after it, and
        # neither module's forward runs then): the ops per module kind
        apart = use_fast_paths(fast.current(), attn_res="recompute")
        with first_calls(model, kinds) as seen, torch.no_grad(), autocast, kda_fp32, apart:
            model(ids, cu_seqlens=cu)
    finally:
        norm_hook.remove()
    seen = {**seen, **norm}
    out = {}
    for kind, (mod, args, kwargs) in seen.items():
        args = tuple(_leaf(a) for a in args)
        inputs = [a for a in _flat(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        params = [p for p in mod.parameters() if p.requires_grad]

        def run(mod=mod, args=args, kwargs=kwargs):
            with autocast:
                return mod(*args, **kwargs)

        counter = count_fwd_bwd(run, inputs, params)
        out[kind] = {"total": counter.total, "ops": dict(counter.ops.most_common())}

    def step():  # the whole model: forward with token logprobs (chunked LM head), backward to every weight
        with autocast, _kda_core_fp32() if bf16 else contextlib.nullcontext():
            return model(ids, cu_seqlens=cu, target_ids=ids.roll(-1, 1), return_logits=False).token_logprobs

    counter = count_fwd_bwd(step, [], [p for p in model.parameters() if p.requires_grad])
    out["model"] = {"total": counter.total, "ops": dict(counter.ops.most_common())}
    return out


@contextlib.contextmanager
def _kda_core_fp32():
    """CPU bf16: the chunked KDA core in fp32 outside autocast (no bf16 triangular solve on the CPU)."""
    import kernels.kda as kda_mod

    real = kda_mod.chunk_kda

    def core(q, k, v, g, beta, **kw):
        with torch.autocast("cpu", enabled=False):
            o, final = real(*(t.float() for t in (q, k, v, g, beta)), **kw)
        return o.to(v.dtype), final

    kda_mod.chunk_kda = core
    try:
        yield
    finally:
        kda_mod.chunk_kda = real


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _leaf(x):
    if isinstance(x, (list, tuple)):
        return type(x)(_leaf(a) for a in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().clone().requires_grad_()
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", type=Path, default=ROOT / "configs/model/gpu_1b.yaml")
    ap.add_argument("--lengths", default="1,15,64,65,300")
    ap.add_argument("--bf16", action="store_true", help="under CPU bf16 autocast (KDA left out)")
    ap.add_argument("--cpu-rms-norm", action="store_true", help="F.rms_norm as the CPU runs it, op by op")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lengths = [int(n) for n in args.lengths.split(",")]
    counts = layer_op_counts(tiny_preset(args.preset), lengths, args.bf16, not args.cpu_rms_norm)
    for kind, row in counts.items():
        top = ", ".join(f"{k} {v}" for k, v in list(row["ops"].items())[:12])
        print(f"{kind:10s} {row['total']:5d}  {top}")
    if args.json:
        args.json.write_text(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
