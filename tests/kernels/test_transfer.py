"""kernels.transfer.to_device: the one host -> device helper of the model and the KDA chunk plan."""

from __future__ import annotations

import subprocess
import sys

import torch

from kernels.transfer import to_device


def test_cpu_copy_is_a_plain_copy_and_model_uses_the_same_helper():
    import kernels.kda.triton.common as common
    import model.layers as layers

    t = torch.arange(5, dtype=torch.int32)
    out = to_device(t, "cpu")
    assert torch.equal(out, t) and out.device.type == "cpu"
    assert layers.to_device is to_device and common.to_device is to_device


def test_importable_without_triton():
    code = "import sys, kernels.transfer; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
