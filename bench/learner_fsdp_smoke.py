"""Smoke run of the sharded learner (rl/parallel.py) at world size 1: FSDP2 + NCCL on one GPU.

    python bench/learner_fsdp_smoke.py --out DIR [--preset gpu_1b] [--tokens 16384] [--steps 2]

One process joins a one-rank NCCL group (gloo on a machine without CUDA), builds the project's learner
with ``dist`` (FSDP2 units per decoder layer's blocks + root, bf16 compute / fp32 reduce and master
weights through ``MixedPrecisionPolicy``), and on packed varlen micro-batches (bench/learner_mfu.py's
``make_batch``) takes ``--steps`` train steps (forward, PG loss, backward, DTensor clip, AdamW). It
checks that the first step's loss and gradient norm match the unsharded learner's on the same batch
(bf16: rel 2e-2; fp32: rel 1e-4), that a DCP checkpoint saved after step 1 resumes to the same step 2
bit for bit (on a GPU within rel 1e-3: some backward kernels accumulate atomically, so step 2 run
twice from the same state differs by itself; ``resumed_step2`` shows both runs), and that the bucketed weight gather returns every tensor of the state dict. Results:
``DIR/learner_fsdp_smoke.json``; exit 1 when a check fails.

Device run (the H200 lacks omegaconf, einops and fla-core; bench/learner_mfu.py says how they are
carried in ``.bench-carry/``)::

    pip install -q --no-index --no-deps --target /tmp/site .bench-carry/*.whl &&
    PYTHONPATH=/tmp/site:$PWD python3 bench/learner_fsdp_smoke.py --out $OUT --preset gpu_1b --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


STEP1_REL_TOL = {"bfloat16": 2e-2, "float32": 1e-4}
"""Relative tolerance of a first step's loss and gradient norm against another learner's on the same batch
(also bench/learner_scaling.py's): bf16 sums the same products in another order; fp32 only rounds."""


def learner_config(arch: dict, tokens: int, dtype: str):
    """The train config of the smoke (and of bench/learner_scaling.py): ``arch`` at model seed 0, micro-batches
    of ``tokens``, lr 1e-5, the sharded learner (FSDP2) at any world size."""
    from rl.config import load_config

    cfg = load_config(None, [])
    cfg.model = replace(cfg.model, arch=arch, seed=0)
    cfg.learner = replace(cfg.learner, dtype=dtype, micro_batch_tokens=tokens, lr=1e-5, torch_threads=None,
                          sharding="fsdp")  # fmt: skip
    return cfg


def step1_matches(got: dict, want: dict, rel: float) -> tuple[bool, bool]:
    """(loss, gradient norm) of ``got`` within ``rel`` of ``want`` (the loss against at least 1e-3: it is a mean
    of advantage-weighted terms that may nearly cancel)."""
    loss = abs(got["loss"] - want["loss"]) <= rel * max(abs(want["loss"]), 1e-3)
    return loss, abs(got["grad_norm"] - want["grad_norm"]) <= rel * want["grad_norm"]


def build(preset: str, tokens: int, dtype: str, dist=None):
    from bench.learner_mfu import load_arch
    from rl.learner import Learner

    cfg = learner_config(load_arch(ROOT / "configs" / "model" / f"{preset}.yaml"), tokens, dtype)
    return Learner(cfg.model, cfg.learner, cfg.algorithm, dist=dist)


def batches(learner, tokens: int, seed: int):
    from bench.learner_mfu import episode_lengths, make_batch

    lengths = episode_lengths(tokens, np.random.default_rng(seed))
    return [[make_batch(lengths, learner.base_model.config, seed=seed)]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--preset", default="gpu_1b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    from rl.parallel import group_store, init_distributed

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = "bfloat16" if cuda else "float32"
    tol = STEP1_REL_TOL[dtype]
    report: dict = {
        "preset": args.preset,
        "tokens": args.tokens,
        "device": str(device),
        "dtype": dtype,
        "checks": {},
    }
    data = [None] * max(args.steps, 2)
    plain = build(args.preset, args.tokens, dtype)
    data = [batches(plain, args.tokens, seed=s) for s in range(len(data))]
    want = plain.train_step(data[0])
    report["unsharded_step1"] = {k: want[k] for k in ("loss", "grad_norm")}
    del plain
    torch.cuda.empty_cache() if cuda else None
    _store, address = group_store()  # the group's store: kept alive until the run ends
    d = init_distributed(0, 1, address, device)
    report["backend"] = d.backend
    learner = build(args.preset, args.tokens, dtype, dist=d)
    steps = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, b in enumerate(data):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            m = learner.train_step(b)
            if cuda:
                torch.cuda.synchronize()
            steps.append({"loss": m["loss"], "grad_norm": m["grad_norm"], "seconds": time.time() - t0,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None})  # fmt: skip
            if i == 0:
                learner.save(str(Path(tmp) / "learner.dcp"))
        resumed = []
        for _ in range(2):  # twice: tells a resume error from the GPU kernels' own nondeterminism
            learner.load(str(Path(tmp) / "learner.dcp"))
            resumed.append(learner.train_step(data[1]))
    report["steps"] = steps
    checks = report["checks"]
    loss_ok, norm_ok = step1_matches(steps[0], want, tol)
    checks["step1_loss_matches_unsharded"], checks["step1_grad_norm_matches_unsharded"] = loss_ok, norm_ok
    report["resumed_step2"] = [{k: r[k] for k in ("loss", "grad_norm")} for r in resumed]
    same = lambda a, b, rel: all(
        abs(a[k] - b[k]) <= rel * max(abs(b[k]), 1e-6) for k in ("loss", "grad_norm")
    )
    report["resume_bitwise"] = all(same(r, steps[1], 0.0) for r in resumed)
    # on a GPU some backward kernels accumulate atomically, so step 2 itself varies run to run
    checks["resume_step2_matches"] = all(same(r, steps[1], 0.0 if not cuda else 1e-3) for r in resumed)
    names = set(learner.base_model.state_dict())
    gathered = {k for b in learner.weight_buckets("full", 64 << 20) for k in b}
    tied = learner.base_model.config.tie_word_embeddings
    checks["gather_has_every_tensor"] = gathered == (names - {"lm_head.weight"} if tied else names)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learner_fsdp_smoke.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
