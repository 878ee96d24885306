"""Bias-free linear layers built without random init (weights are always loaded right after)."""

from __future__ import annotations

import torch
from torch import nn


def linear(n_in: int, n_out: int, dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Linear:
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out, bias=False, dtype=dtype, device=device)
    layer.weight.requires_grad_(False)
    return layer
