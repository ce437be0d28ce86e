"""rl tests run on 2 shared cores: one thread (OpenMP spinning on tiny ops costs far more than it gains)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
