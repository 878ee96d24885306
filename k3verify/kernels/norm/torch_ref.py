"""RMSNorm and gated RMSNorm in plain torch: the serving layers' math, op for op.

RMSNorm normalizes in fp32, casts back to the input dtype, then multiplies by the weight in the
weight's dtype (the result dtype is torch's promotion of the two). Gated RMSNorm (KDA o_norm) stays
in fp32 through norm x weight x sigmoid(gate) and casts back once.
"""

from __future__ import annotations

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., W]; weight [W] -> [..., W] in promote_types(weight.dtype, x.dtype)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: (s, rms_norm_torch(s)) with s = x + residual in x's dtype."""
    s = x + residual
    return s, rms_norm_torch(s, weight, eps)


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., W]; weight [W] -> [..., W] in x.dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)
