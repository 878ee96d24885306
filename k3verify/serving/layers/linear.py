"""Bias-free linear layers built without random init (weights are always loaded right after)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# Builds a projection (n_in, n_out, dtype, device) -> module with a [n_out, n_in] `weight`: a layer takes the one
# that computes its output as a part (`linear` here; a tensor-parallel rank's row-parallel projection, which
# all-reduces its partial sum: serving/parallel/layers.py).
LinearFactory = Callable[[int, int, torch.dtype, "torch.device | str | None"], nn.Module]


def linear(n_in: int, n_out: int, dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Linear:
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out, bias=False, dtype=dtype, device=device)
    layer.weight.requires_grad_(False)
    return layer
