"""Host-to-device copies that never make the host wait.

A copy from pageable memory synchronises: the host stalls until the device has drained
its queue. Every per-step upload (a step's inputs, its plan's index tensors, a kernel's
tile map) therefore goes through pinned memory on CUDA and is enqueued without blocking.
One idiom, one place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["upload", "upload_lists"]


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, copied asynchronously (pinned on CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def upload_lists(
    lists: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """Host int lists -> tensors of ``dtype`` on ``device``, in one copy (views of it)."""
    sizes = [len(v) for v in lists]
    flat = upload(torch.tensor([i for v in lists for i in v], dtype=dtype), device)
    return list(flat.split(sizes))
