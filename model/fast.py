"""Which implementation each hot operator runs: the readable reference or its fast path.

Every operator with a fast path keeps its reference beside it (the code the tests hold the math
to); the choice is process-wide, read at each call, with "auto" resolved by the tensor's device:

| op | reference | fast path | "auto" on CUDA | "auto" on CPU |
|---|---|---|---|---|
| ``moe`` | ``loop``: one GLU per expert (``GroupedExperts._loop``) | ``grouped``: permute, grouped GEMM, unpermute (``kernels.moe``) | grouped | grouped (measured faster) |
| ``attention`` | ``loop``: one SDPA per sequence | ``varlen``: PyTorch's varlen flash attention; ``flex``: FlexAttention with a document-causal block mask | bf16/fp16: varlen if importable, else flex; fp32: loop | loop |
| ``conv`` | ``torch``: the shifted-tap PyTorch conv | ``triton``: one varlen causal conv kernel (``kernels.conv``); ``triton_fused``: the same with its backward's two passes in one kernel (``kernels.conv.triton.BACKWARD_KERNELS``; the A/B: passes the bf16 step check; on an H100 no faster in the graphed step, slower without graphs); ``triton_bf16`` (the default): the two passes with dpre stored in the input's dtype (bf16 in training: 12 bytes an element instead of 16; on an H100 6.3 -> 5.3 ms of a gpu_1b step's convs, the step 168 -> 167 ms graphed; ``triton``: dpre in fp32, the A/B) | triton_bf16 | torch |
| ``lm_head`` | ``plain``: [T, V] logits, then log-softmax | ``chunked``: logits per token chunk, recomputed in backward (``model.lm_head``) | chunked | chunked (measured faster) |
| ``glu`` | ``torch``: SiTU / SiLU-GLU by autograd (keeps its fp32 intermediates for backward) | ``recompute``: the same ops, only gate/up kept, recomputed in backward (bit-exact); ``triton``: SiTU-GLU as one fused kernel each way (``kernels.glu``; SiLU takes ``recompute``) | triton | recompute |
| ``attn_res`` | ``torch``: the AttnRes mix by autograd (keeps the stacked sources and norm intermediates) | ``recompute``: the same ops, only the sources kept, recomputed in backward (bit-exact); ``fused``: the mix and the sub-layer's RMSNorm after it as one node keeping only the sources (``model.attnres.attn_res_mix_norm`` forward, bit-exact eager; its closed-form gradient ``attn_res_mix_norm_grads`` backward, to fp32 rounding: one compiled call each way); ``triton``: that node on two Triton kernels over the unstacked sources, each reading every source row once (``kernels.attnres.triton``; CUDA, up to 8 sources, else ``fused``); ``triton_passes``: the same with the backward kernel that walks a row's sources as vectors instead of holding them as one tile (``kernels.attnres.triton.BACKWARD_KERNELS``; the A/B: passes the bf16 step check; on an H100 no faster in the graphed step, slower without graphs); ``triton_rows``: the backward walking BR rows' sources as [BR, BD] tiles (the next A/B, not yet on a GPU) | triton | fused |
| ``norm`` | ``torch``: RMSNorm and L2 norm by autograd (keep an fp32 normalised copy) | ``recompute``: the same ops, only the input kept (bit-exact) | recompute | recompute |
| ``attn_res_grads`` | ``autograd``: each mix-and-norm node hands autograd every source's gradient, autograd sums a shared source's with one more pass each | ``shared``: a completed block's later mixes add its gradient into one buffer, in the Triton backward itself on CUDA, its earliest mix returns it (``model.attnres.SharedSourceGrads``; the PyTorch node: the same sums in the same order, bit-exact) | shared | shared |

"recompute" means what autograd keeps: under ``model.compile`` a compiled norm, GLU or KDA region is not
checkpointed, its graph's partitioner keeps the inputs and per-row statistics and recomputes the rest inside
the compiled backward (``model.layers.recompute_region``: one compiled call a region instead of two); an
AttnRes mix is never left to a compiled graph's partitioner (it would keep a stacked copy of the sources): with
its norm it is one node keeping the sources (``fused``), alone it is checkpointed (``recompute``).

The CPU column is what was measured no slower on the 2-core CPU box (cpu_tiny, 2048 packed tokens,
one thread, interleaved runs, best of 6-8: MoE layer fwd+bwd 53 vs 85 ms, LM head with logprob and
entropy 116 vs 140 ms, whole learner step 1.40 vs 1.70 s); tests/model/test_fast_paths.py holds every
fast path to its reference there. ``use_fast_paths("reference")`` runs everything
through the references, e.g. to check a GPU step against them. ``LONGHORIZON_FAST_PATHS`` (the same spec,
e.g. ``attn_res=torch``; read at import) sets the process-wide default: what a rollout engine's process runs,
where no learner config reaches (the learner's ``learner.fast_paths`` applies inside its own steps).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch

CHOICES = {
    "moe": ("auto", "loop", "grouped"),
    "attention": ("auto", "loop", "varlen", "flex"),
    "conv": ("auto", "torch", "triton", "triton_fused", "triton_bf16"),
    "lm_head": ("auto", "plain", "chunked"),
    "glu": ("auto", "torch", "recompute", "triton"),
    "attn_res": ("auto", "torch", "recompute", "fused", "triton", "triton_passes", "triton_rows"),
    "norm": ("auto", "torch", "recompute"),
    "attn_res_grads": ("auto", "autograd", "shared"),
}


@dataclass(frozen=True)
class FastPaths:
    moe: str = "auto"
    attention: str = "auto"
    conv: str = "auto"
    lm_head: str = "auto"
    glu: str = "auto"
    attn_res: str = "auto"
    norm: str = "auto"
    attn_res_grads: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value not in CHOICES[f.name]:
                raise ValueError(f"fast path {f.name}={value!r}: choose one of {CHOICES[f.name]}")

    @classmethod
    def reference(cls) -> FastPaths:
        return cls(moe="loop", attention="loop", conv="torch", lm_head="plain", glu="torch", attn_res="torch",
                   norm="torch", attn_res_grads="autograd")

    @classmethod
    def parse(cls, spec: FastPaths | str | dict) -> FastPaths:
        """``"auto"``, ``"reference"``, a FastPaths, a dict, or ``"moe=loop,attention=flex"``."""
        if isinstance(spec, FastPaths):
            return spec
        if isinstance(spec, dict):
            return cls(**spec)
        if spec in ("auto", ""):
            return cls()
        if spec == "reference":
            return cls.reference()
        pairs = [p.split("=", 1) for p in spec.split(",") if p]
        bad = [p[0] for p in pairs if len(p) != 2 or p[0] not in CHOICES]
        if bad:
            raise ValueError(f"fast paths {spec!r}: unknown ops {bad}; ops are {sorted(CHOICES)}")
        return cls(**dict(pairs))


def _from_environment() -> FastPaths:
    spec = os.environ.get("LONGHORIZON_FAST_PATHS", "auto")
    try:
        return FastPaths.parse(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"LONGHORIZON_FAST_PATHS={spec!r}: {e}") from None


_current = _from_environment()


def current() -> FastPaths:
    return _current


def set_fast_paths(spec: FastPaths | str | dict) -> FastPaths:
    """Set the process-wide choice; returns the previous one."""
    global _current
    previous, _current = _current, FastPaths.parse(spec)
    return previous


@contextlib.contextmanager
def use_fast_paths(spec: FastPaths | str | dict, **overrides: str) -> Iterator[FastPaths]:
    paths = replace(FastPaths.parse(spec), **overrides)
    previous = set_fast_paths(paths)
    try:
        yield paths
    finally:
        set_fast_paths(previous)


def _varlen_attn_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def pick(op: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The implementation ``op`` runs for tensors on ``device`` of ``dtype`` ("auto" resolved).

    Attention in fp32 on CUDA stays on the reference: flash attention has no fp32 kernel, and the
    compiled FlexAttention kernels for fp32 at the MLA head sizes need more shared memory than an
    H200 has (279 KB > 232 KB, measured), so they fail to compile."""
    choice = getattr(_current, op)
    if choice != "auto":
        return choice
    cuda = device.type == "cuda"
    if op == "moe":
        return "grouped"
    if op == "attention":
        if not cuda or dtype == torch.float32:
            return "loop"
        return "varlen" if _varlen_attn_available() else "flex"
    if op == "conv":  # dpre in bf16: the convs 6.3 -> 5.3 ms a 16K step on an H100 (bench/learner_kernels.py)
        return "triton_bf16" if cuda else "torch"
    if op == "lm_head":
        return "chunked"
    if op == "glu":
        return "triton" if cuda else "recompute"
    if op == "attn_res":  # the Triton node measured 211 -> 179 ms a 16K step on an H100 (CUDA graphs)
        return "triton" if cuda else "fused"
    if op == "norm":
        return "recompute"
    if op == "attn_res_grads":
        return "shared"
    raise ValueError(f"unknown fast-path op {op!r}; ops are {sorted(CHOICES)}")
