"""Small host->device and device->host copies that never make the host wait for the GPU.

A copy from pageable host memory synchronises (the driver stages it), so every per-step transfer of the
engine goes through pinned buffers: `HostStaging` for the few int64s a step sends (slots, positions,
seeds), `PinnedReadback` for the token ids it brings back. A pinned buffer is reused only after the copy
that last read or wrote it has completed (its event), so a buffer is never overwritten in flight.
On a CPU device both are plain synchronous copies.
"""

from __future__ import annotations

import torch


class _Ring:
    """`depth` byte buffers (pinned on CUDA) used round-robin, each guarded by the event of its last copy."""

    def __init__(self, pinned: bool, depth: int, capacity: int) -> None:
        self.pinned = pinned
        self.buffers = [torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned) for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0

    def take(self, n: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """The next buffer as n elements of dtype, once its previous copy has completed."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        event = self.events[i]
        if event is not None and not event.query():  # normally long done: issued `depth` calls ago
            event.synchronize()
        nbytes = n * dtype.itemsize
        if self.buffers[i].numel() < nbytes:
            self.buffers[i] = torch.empty(max(nbytes, 2 * self.buffers[i].numel()), dtype=torch.uint8,
                                          pin_memory=self.pinned)
        return i, self.buffers[i][:nbytes].view(dtype)

    def issued(self, i: int) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        self.events[i] = event
        return event


class HostStaging:
    """int64 host lists -> device tensors without a synchronising pageable copy."""

    def __init__(self, device: torch.device, depth: int = 8, capacity: int = 4096) -> None:
        self.device = device
        self._ring = _Ring(device.type == "cuda", depth, capacity)

    def copy_into(self, dst: torch.Tensor, values: list[int]) -> None:
        """dst (an int64 device tensor of len(values) elements, any shape, contiguous) <- values."""
        if dst.numel() != len(values) or dst.dtype != torch.long or not dst.is_contiguous():
            raise ValueError(f"staging {len(values)} int64 values into a {dst.dtype} tensor of {dst.numel()} "
                             f"(contiguous: {dst.is_contiguous()})")
        if not self._ring.pinned:
            dst.copy_(torch.tensor(values, dtype=torch.long).view(dst.shape))
            return
        i, buf = self._ring.take(len(values), torch.long)
        buf.copy_(torch.tensor(values, dtype=torch.long))
        dst.copy_(buf.view(dst.shape), non_blocking=True)
        self._ring.issued(i)

    def to_device(self, values: list[int]) -> torch.Tensor:
        dst = torch.empty(len(values), dtype=torch.long, device=self.device)
        self.copy_into(dst, values)
        return dst


class PinnedReadback:
    """Device tensors -> host, started now and read later (after `event`), without blocking the launch."""

    def __init__(self, device: torch.device, depth: int = 8, capacity: int = 1 << 16) -> None:
        self.device = device
        self._ring = _Ring(device.type == "cuda", depth, capacity)

    def start(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Begin copying a 1-D device tensor to the host; returns (host tensor, event to wait on, None on
        CPU). The host tensor is valid once the event completed and until `depth` further starts."""
        if src.dim() != 1:
            raise ValueError(f"readback takes a 1-D tensor; got {tuple(src.shape)}")
        if not self._ring.pinned:
            return src.to("cpu", copy=True), None
        i, buf = self._ring.take(src.numel(), src.dtype)
        buf.copy_(src, non_blocking=True)
        return buf, self._ring.issued(i)
