"""Shared fixtures: a tiny random-init hybrid checkpoint in fp32 with every feature of the CPU preset
(KDA x3 + gated MLA, dense first FFN then latent SiTU MoE, Block AttnRes, tied embeddings)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: OpenMP spinning costs 1000x on tiny ops
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

torch.set_num_threads(1)

from rollout_cases import SMALL_ENGINE, build_checkpoint  # noqa: E402 (after the env defaults)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hybrid")
    model = build_checkpoint(path)
    return path, model


@pytest.fixture(scope="session")
def session_worker(tiny_ckpt):
    """One session-reuse engine shared by the test modules that do not change its weights."""
    from rollout.worker import RolloutWorker

    path, _ = tiny_ckpt
    w = RolloutWorker(dict(model_path=str(path), reuse="session", **SMALL_ENGINE))
    yield w
    w.shutdown()
