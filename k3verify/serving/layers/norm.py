"""RMSNorm and gated RMSNorm modules; the math lives in kernels/norm (torch reference + fused Triton).

RMSNorm: normalize in fp32, cast back to the input dtype, then multiply by the weight (in the
weight's dtype, like the reference). Gated RMSNorm (KDA o_norm): fp32 norm x fp32 weight x
sigmoid(gate), cast back once.
"""

from __future__ import annotations

import torch
from torch import nn

from k3verify.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) with s = x + residual (x itself when residual is None): the residual add fused into the
        norm (one launch on CUDA), the same bits as the add followed by forward()."""
        if residual is None:
            return x, self.forward(x)
        return add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per-head norm over the last dim (head_dim); the weight is held in fp32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
