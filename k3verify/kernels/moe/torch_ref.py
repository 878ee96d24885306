"""The reference combine is SparseMoE.combine itself (serving/layers/moe.py): a loop over the experts
that were hit, in ascending id order, with host-side counts."""

from __future__ import annotations

from typing import Any

import torch


def combine_loop(moe: Any, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return moe.combine(x_in, weights, idx)
