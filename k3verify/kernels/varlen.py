"""Sequence offsets of a static pack: on the device only, with the bounds a captured graph is shaped by on the host.

An eager pack carries its offsets twice, as a device tensor and as host ints (kernels loop over, or size grids by,
the host copy without a sync). A pack replayed from a CUDA graph cannot: the host ints of the capture are baked
into the graph, and a replay over other lengths would read them stale. A `DeviceSeqlens` therefore gives the host
only what the capture fixes (how many sequences, how many tokens, how long any one may be); the lengths themselves
live in `cu`, a buffer refilled before every replay.

Fast paths read `cu` on the device. A reference backend that needs the lengths on the host calls `host()`, a
device read: free on the CPU, and under CUDA capture an error (a sync is not capturable) rather than a silently
baked value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSeqlens:
    cu: torch.Tensor  # [num_seqs + 1] int64 on the pack's device: offsets; trailing sequences may be empty
    num_tokens: int  # == cu[-1] (the bucket's token count: filler sequences make up the difference)
    max_len: int  # no sequence is longer (the bucket's bound)

    def __post_init__(self) -> None:
        if self.cu.dim() != 1 or self.cu.dtype != torch.long or self.cu.numel() < 2:
            raise ValueError(f"cu must be 1-D int64 with at least 2 entries; got {tuple(self.cu.shape)} "
                             f"{self.cu.dtype}")
        if self.num_tokens < 1 or self.max_len < 1:
            raise ValueError(f"a static pack needs tokens and a positive length bound; got {self.num_tokens} tokens, "
                             f"max_len {self.max_len}")

    @property
    def num_seqs(self) -> int:
        return self.cu.numel() - 1

    def host(self) -> list[int]:
        """The offsets on the host (reference backends only): a device read."""
        return self.cu.tolist()


Offsets = list[int] | DeviceSeqlens


def host_offsets(cu: Offsets) -> list[int]:
    """A reference backend's view of either kind of offsets."""
    return cu.host() if isinstance(cu, DeviceSeqlens) else cu
