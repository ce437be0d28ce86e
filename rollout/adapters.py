"""Adapter-only weight sync: LoRA adapters (peft's format) applied to the running vLLM model in place.

The rollout model has no LoRA layers (plain ``nn.Linear``, see ``rollout.vllm_model``), so an
adapter update folds the adapter into the weights: for every targeted Linear,
``W = W_base + scale * (B @ A)``, and per expert for the stacked routed-expert weights
(``AdapterTarget``) with ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), the
same arithmetic, in the same order, as peft's ``merge_adapter``; an fp32 engine therefore ends up
with bitwise the weights of the learner's merged export.

Every adapter update is relative to the base, never to the previous adapter: the model keeps a
pristine copy of each base weight an adapter has touched (``_lh_lora_base``, only
those). Deviation from "copy at load": the copy of a module is taken the first time an adapter
targets it (until then the running weight *is* the base, since only adapters change it), which
needs no knowledge of the learner's target list. A full weight update replaces the base copy of
every tensor it carries. A module adapted before but absent from the new adapter is reset to its
base, so the engine always equals "base + this adapter".

Tensor names are peft's ``save_pretrained`` names, ``base_model.model.<module path>.lora_A.weight``
([r, in]) and ``.lora_B.weight`` ([out, r]); the module path is the learner's, which is also the
vLLM model's (same module tree). Everything is checked before the first weight changes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_BASE_ATTR = "_lh_lora_base"


@dataclass
class AdapterWeights:
    """One LoRA adapter: peft-named tensors and the scale its deltas are applied with."""

    tensors: dict[str, torch.Tensor]  # PEFT_PREFIX<module>.lora_A.weight [r, in], .lora_B.weight [out, r]
    r: int
    alpha: float
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> AdapterWeights:
        """Read a peft adapter directory (adapter_config.json + adapter_model.safetensors)."""
        from safetensors.torch import load_file

        p = Path(path)
        if not is_adapter_dir(p):
            raise FileNotFoundError(
                f"{p} is not a LoRA adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
            )
        cfg = json.loads((p / ADAPTER_CONFIG).read_text())
        return cls(load_file(str(p / ADAPTER_WEIGHTS)), **_scale_fields(cfg, str(p / ADAPTER_CONFIG)))

    def save(self, path: str | os.PathLike) -> Path:
        """Write a directory ``from_dir`` reads (the transport to an engine in another process)."""
        from safetensors.torch import save_file

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        cfg = {"peft_type": "LORA", "r": self.r, "lora_alpha": self.alpha, "use_rslora": self.use_rslora}
        (p / ADAPTER_CONFIG).write_text(json.dumps(cfg))
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}, str(p / ADAPTER_WEIGHTS)
        )
        return p


def is_adapter_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file() and (p / ADAPTER_WEIGHTS).is_file()


def is_adapter_update(weights, adapter_only: bool | None) -> bool:
    """Whether a worker update is adapter-only; ``adapter_only=None`` decides from what ``weights`` is."""
    is_adapter = isinstance(weights, AdapterWeights) or (
        isinstance(weights, str | os.PathLike) and is_adapter_dir(weights)
    )
    if adapter_only and not is_adapter:
        raise ValueError(f"adapter_only update needs AdapterWeights or a peft adapter dir, got {weights!r}")
    if adapter_only is False and is_adapter:
        what = "AdapterWeights" if isinstance(weights, AdapterWeights) else repr(str(weights))
        raise ValueError(f"{what} is a LoRA adapter, not full weights (pass adapter_only=True)")
    return is_adapter


def _scale_fields(cfg: dict, where: str) -> dict:
    """r, alpha and rsLoRA from a peft LoraConfig dict; features this path cannot apply are rejected."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": "DoRA adapters",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) layers",
        "modules_to_save": "fully trained extra modules (modules_to_save)",
        "lora_bias": "LoRA biases",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ValueError(
                f"{where}: {what} cannot be applied as an adapter-only update ({key}={cfg[key]!r})"
            )
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1 or "lora_alpha" not in cfg:
        raise ValueError(f"{where}: needs an integer r >= 1 and lora_alpha, got r={cfg.get('r')!r}")
    return {
        "r": cfg["r"],
        "alpha": float(cfg["lora_alpha"]),
        "use_rslora": bool(cfg.get("use_rslora", False)),
    }


@dataclass
class AdapterTarget:
    """One adapted weight of the model: ``param`` (its name) gets ``scale * delta(A, B)``.

    An nn.Linear weight [out, in]: A [r, in], B [out, r], delta = B @ A. A stacked expert weight [E, out, in]
    (``model.moe.GroupedExperts``, adapted through peft's ``target_parameters``): one rank-r adapter per
    expert, A [E r, in] (expert e's rows e r .. e r + r - 1), B [out, r E] (interleaved: column j E + e), and
    delta[e] = B_e @ A_e, the einsum of peft's ``ParamWrapper.get_delta_weight``."""

    param: str
    A: torch.Tensor
    B: torch.Tensor
    experts: int = 0  # 0: an nn.Linear weight

    def delta(self, scale: float, device: torch.device) -> torch.Tensor:
        A, B = self.A.to(device, torch.float32), self.B.to(device, torch.float32)
        if not self.experts:
            return (B @ A) * scale
        E = self.experts
        r = A.shape[0] // E
        return torch.einsum("o r e, e r i -> e o i", B.view(B.shape[0], r, E), A.view(E, r, -1)) * scale


def adapter_deltas(model: nn.Module, adapter: AdapterWeights) -> dict[str, AdapterTarget]:
    """Weight name -> its ``AdapterTarget``, every name and shape checked against ``model``."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapter.tensors.items():
        for kind in ("lora_A", "lora_B"):
            suffix = f".{kind}.weight"
            if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
                pairs.setdefault(key[len(PEFT_PREFIX) : -len(suffix)], {})[kind] = t
                break
        else:
            raise ValueError(
                f"adapter tensor {key!r} is not a LoRA weight named {PEFT_PREFIX}<module>.lora_A/B.weight"
            )
    modules = dict(model.named_modules())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    out: dict[str, AdapterTarget] = {}
    for path, ab in sorted(pairs.items()):
        owner_path, owner = _adapted_module(modules, path)
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"adapter for {path!r} has {sorted(ab)} only; it needs lora_A and lora_B")
        if tied and path == "lm_head":
            raise ValueError("adapter targets lm_head, which is tied to the embedding in this model")
        target = _target(owner, owner_path, path, ab["lora_A"], ab["lora_B"], adapter.r)
        if target.param in out:
            raise ValueError(f"two adapters in the file target {target.param!r}")
        out[target.param] = target
    return out


def _adapted_module(modules: dict[str, nn.Module], path: str) -> tuple[str, nn.Module]:
    """(path, module) of what an adapter at ``path`` adapts: an nn.Linear, or the routed experts (peft nests
    the wrappers of several target parameters of one module: ``experts``, ``experts.base_layer``, ...)."""
    from model.moe import GroupedExperts

    owner_path = path
    while owner_path.endswith(".base_layer"):
        owner_path = owner_path.removesuffix(".base_layer")
    mod = modules.get(owner_path)
    if isinstance(mod, GroupedExperts) or (isinstance(mod, nn.Linear) and owner_path == path):
        return owner_path, mod
    found = "no module" if mod is None else f"a {type(mod).__name__}, not an nn.Linear or the routed experts"
    raise ValueError(f"adapter targets {path!r}: the vLLM model has {found} there")


def _target(mod: nn.Module, mod_path: str, path: str, A: torch.Tensor, B: torch.Tensor, r: int) -> AdapterTarget:
    """The weight of ``mod`` (at ``mod_path``, ``_adapted_module``) the adapter at ``path`` adapts; for the
    routed experts which of their two weights follows from the adapter's shapes."""
    if isinstance(mod, nn.Linear):
        want_A, want_B = (r, mod.in_features), (mod.out_features, r)
        if tuple(A.shape) != want_A or tuple(B.shape) != want_B:
            raise ValueError(
                f"adapter for {path!r}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit "
                f"r={r} and the Linear's weight {tuple(mod.weight.shape)} (want {want_A} / {want_B})"
            )
        return AdapterTarget(f"{mod_path}.weight", A, B)
    E = mod.num_experts
    for name in ("gate_up_proj", "down_proj"):
        _, out_f, in_f = getattr(mod, name).shape
        if tuple(A.shape) == (r * E, in_f) and tuple(B.shape) == (out_f, r * E):
            return AdapterTarget(f"{mod_path}.{name}", A, B, experts=E)
    raise ValueError(
        f"adapter for {path!r}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} fit neither expert weight "
        f"(gate_up_proj {tuple(mod.gate_up_proj.shape)}, down_proj {tuple(mod.down_proj.shape)}) at r={r}"
    )


@torch.no_grad()
def apply_adapter(model: nn.Module, adapter: AdapterWeights) -> int:
    """Set every targeted weight to base + scale * delta (others adapted before back to base)."""
    deltas = adapter_deltas(model, adapter)  # raises before anything changes
    base: dict[str, torch.Tensor] = model.__dict__.setdefault(_BASE_ATTR, {})
    params = dict(model.named_parameters())
    for name in deltas:
        if name not in base:  # never adapted since its last full load: the running weight is the base
            base[name] = params[name].detach().clone()
    for name, W_base in base.items():
        W = params[name]
        if name in deltas:
            # peft's merge order: W + delta * scale, here in fp32 whatever the engine dtype
            W.copy_((W_base.float() + deltas[name].delta(adapter.scale, W_base.device)).to(W.dtype))
        else:
            W.copy_(W_base)
    return len(deltas)


def rebase_after_full_update(model: nn.Module, names: list[str]) -> int:
    """A full update carried these tensors: they are the new base of any weight adapted so far."""
    base: dict[str, torch.Tensor] = model.__dict__.get(_BASE_ATTR, {})
    params = dict(model.named_parameters())
    refreshed = 0
    for name in names:
        if name in base:
            base[name] = params[name].detach().clone()
            refreshed += 1
    return refreshed


# --- functions run inside vLLM's model-runner process (sent with collective_rpc) -----------------------
def apply_adapter_inplace(worker, adapter: AdapterWeights | str) -> int:
    """``adapter``: the weights themselves (engine in this process) or an adapter directory."""
    if isinstance(adapter, str):
        adapter = AdapterWeights.from_dir(adapter)
    return apply_adapter(worker.model_runner.get_model(), adapter)


def rebase_inplace(worker, names: list[str]) -> int:
    return rebase_after_full_update(worker.model_runner.get_model(), names)
