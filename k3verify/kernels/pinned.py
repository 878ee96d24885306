"""Host ints for a device: a copy with non_blocking=True from pageable memory may make the host wait for the
stream (the CUDA driver stages it), so on CUDA the host side is pinned (torch's caching host allocator keeps
the block until the copy that reads it has run). serving/staging.HostStaging is the ring for the per-step
copies of the engine; this is for the odd tensor a layer or a kernel wrapper builds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def host_tensor(values: Sequence[Any], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values as a host tensor, pinned when `device` is a CUDA device."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(values: Sequence[Any], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values on `device`, copied without waiting for the stream."""
    return host_tensor(values, device, dtype).to(device, non_blocking=True)
