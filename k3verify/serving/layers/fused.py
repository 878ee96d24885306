"""Linears that read the same input, run as one GEMM (KDA's q/k/v/f_a/g/b, MLA's q/kv_a/g).

Each member stays an nn.Linear under its checkpoint name, so the strict loader and every check see the
same parameters as before; what changes is where its weight lives: a row block of one [sum(out), in]
tensor allocated here. Loading writes straight into the blocks, nothing is stored twice, and a forward
is one GEMM split back into the members' outputs (views of one [T, sum(out)] result).

Only half precision runs the single GEMM. fp32 runs the members one by one over their blocks, exactly as
unfused linears: a GEMM's rounding depends on its output width, and the fp32 module checks hold these
layers to the oracle bit for bit (the bf16 path is held to tolerances and to the fp32 gold).

A member whose weight is replaced rather than written in place (`to_empty()` then a load, `.to(device)`,
an assigned Parameter) would leave its block stale: every call checks the members' data pointers and,
when one moved, fuses again from the members' current values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinears:
    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        self.members = list(linears)
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self._fuse()

    def _fuse(self) -> None:
        """Allocate the fused weight on the members' device, copy their values in, make them its blocks."""
        weights = [lin.weight for lin in self.members]
        first = weights[0]
        odd = [tuple(w.shape) for w in weights if w.shape[1] != first.shape[1] or w.dtype != first.dtype
               or w.device != first.device]
        if odd:
            raise ValueError(f"fused linears must share input width, dtype and device; {tuple(first.shape)} "
                             f"{first.dtype} {first.device} vs {odd}")
        self.weight = torch.empty(sum(self.sizes), first.shape[1], dtype=first.dtype, device=first.device)
        for block, lin in zip(self.weight.split(self.sizes), self.members, strict=True):
            block.copy_(lin.weight.detach())
            lin.weight = nn.Parameter(block, requires_grad=False)
        self._ptrs = [lin.weight.data_ptr() for lin in self.members]
        self.fused = first.dtype in (torch.bfloat16, torch.float16)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[T, in] -> each member's [T, out_i], as column slices of one GEMM's output."""
        if [lin.weight.data_ptr() for lin in self.members] != self._ptrs:
            # A member's weight was replaced rather than written in place (a module materialised with
            # to_empty() then loaded, moved with .to()): fuse again from the members' current values.
            self._fuse()
        if not self.fused:
            return [F.linear(x, lin.weight) for lin in self.members]
        return list(F.linear(x, self.weight).split(self.sizes, dim=-1))
