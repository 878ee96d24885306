"""The reference combine is SparseMoE.combine itself (serving/layers/moe.py): a loop over the experts
that were hit, in ascending id order, with host-side counts."""

from __future__ import annotations

from typing import Any

import torch


def combine_loop(moe: Any, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                 add: torch.Tensor | None = None) -> torch.Tensor:
    """The loop's fp32 sum; with `add`, rounded to add's dtype plus add (the layer's shared-expert add)."""
    out = moe.combine(x_in, weights, idx)
    return out if add is None else out.to(add.dtype) + add
