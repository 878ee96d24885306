"""RMSNorm and gated RMSNorm.

RMSNorm: normalize in fp32, cast back to the input dtype, then multiply by the weight (in the
weight's dtype, like the reference). Gated RMSNorm (KDA o_norm): fp32 norm x fp32 weight x
sigmoid(gate), cast back once.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head norm over the last dim (head_dim); the weight is held in fp32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float() * torch.sigmoid(gate.float())).to(x.dtype)
