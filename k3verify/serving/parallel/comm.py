"""The collectives a rank's layers call, over torch.distributed (gloo on CPU, NCCL on GPU).

A sum is reduced in fp32 whatever its input's dtype and rounded once to it: a bf16 ring would round its running
sum at every hop (W - 1 roundings at W ranks), and would round the MoE's fp32 partial sums (parallel/moe.py) before
adding them. What the collective cannot undo is a partial its producer already rounded: a row-parallel GEMM
(o_proj, down_proj) outputs the activation dtype, so in bf16 each rank's partial is rounded once there, where
the single-process GEMM rounds the whole sum once. Held in bf16 by the dist.reduce.fp32 and dist.moe.bf16 checks.
A world of one has no process group and every collective is the identity, which is how the same layers run
unsplit.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from k3verify.serving.parallel.layout import ParallelLayout

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# A rank that never joins a collective must fail a run in seconds, not hang it for the default 30 minutes.
DEFAULT_TIMEOUT_S = 120.0


class Comm:
    """One rank's view of the world: its layout and the process group its collectives run on."""

    def __init__(self, layout: ParallelLayout, group: Any = None, *, planning: bool = False) -> None:
        self.layout, self.group, self.planning = layout, group, planning
        self.calls: dict[str, int] = {}  # collectives issued, by kind: the empty-rank check reads them
        if planning:  # a rank built on the meta device to be measured or reconciled: it never communicates
            return
        if layout.world > 1 and not dist.is_initialized():
            raise RuntimeError(f"{layout.describe()} needs torch.distributed initialized (init_world) first")
        if layout.world > 1 and dist.get_world_size(group) != layout.world:
            raise RuntimeError(f"the process group has {dist.get_world_size(group)} ranks; the layout "
                               f"{layout.describe()} needs {layout.world}")

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world(self) -> int:
        return self.layout.world

    def _count(self, kind: str) -> None:
        if self.planning:
            raise RuntimeError(f"rank {self.rank} of {self.layout.describe()} was built for planning and has no "
                               f"process group: it cannot {kind}")
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `t`, reduced in fp32 and returned in t's dtype (an fp32 `t` is reduced in place)."""
        if self.world == 1:
            return t
        self._count("all_reduce")
        buf = t.float()
        dist.all_reduce(buf, group=self.group)
        return buf.to(t.dtype)

    def all_gather(self, t: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim` in rank order; rank r's piece is sizes[r] wide there
        (uneven pieces are padded to the widest for the collective and trimmed after)."""
        if self.world == 1:
            return t
        self._count("all_gather")
        dim = dim % t.dim()
        if t.shape[dim] != sizes[self.rank]:
            raise ValueError(f"rank {self.rank}: all_gather piece is {t.shape[dim]} wide along dim {dim}; "
                             f"the layout says {sizes[self.rank]}")
        widest = max(sizes)
        piece = t
        if t.shape[dim] < widest:
            pad = list(t.shape)
            pad[dim] = widest - t.shape[dim]
            piece = torch.cat([t, t.new_zeros(pad)], dim=dim)
        pieces = [torch.empty_like(piece) for _ in range(self.world)]
        dist.all_gather(pieces, piece.contiguous(), group=self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, sizes, strict=True)], dim=dim)


def init_world(layout: ParallelLayout, device: torch.device, init_file: str,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """Join the world of `layout` through a shared rendezvous file (gloo on CPU, NCCL on CUDA); a world of
    one needs no process group."""
    if layout.world == 1:
        return Comm(layout)
    backend = BACKENDS.get(device.type)
    if backend is None:
        raise ValueError(f"no torch.distributed backend for device {device}; expected one of {sorted(BACKENDS)}")
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=layout.rank, world_size=layout.world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return Comm(layout)


def leave_world(comm: Comm) -> None:
    if comm.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
