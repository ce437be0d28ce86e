"""Host -> device copies that do not make the host wait (no Triton, importable without a GPU).

``to_device`` is the one helper the model's sequence layout, its replayed routes and the KDA chunk
plan use for their small host-built index tensors.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without a host sync: a CPU tensor bound for CUDA goes through pinned memory,
    asynchronously (a pageable copy waits for the stream). The caching host allocator keeps the pinned
    block until the copy has run, so the temporary pinned copy may be dropped at once. Any other pair
    of devices is a plain ``t.to(device)``."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
