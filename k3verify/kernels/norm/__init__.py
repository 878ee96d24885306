"""RMSNorm (`rms_norm`) and the KDA output norm (`gated_rms_norm`) over the last dim.

CPU runs the torch reference (torch_ref); CUDA runs one fused Triton kernel per call when it accepts
the call (bf16/fp16 activations), else the torch reference with a logged reason (kernels/registry.py).
"""

from __future__ import annotations

import torch

from k3verify.kernels.norm import norm_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, dispatch

RMS = "norm.rms"
GATED_RMS = "norm.gated_rms"
ADD_RMS = "norm.add_rms"

REGISTRY.register(RMS, TORCH, torch_ref.rms_norm_torch)
REGISTRY.register(RMS, TRITON, norm_launch.rms_norm_triton, accepts=norm_launch.accepts_rms,
                  available=norm_launch.available)
REGISTRY.register(ADD_RMS, TORCH, torch_ref.add_rms_norm_torch)
REGISTRY.register(ADD_RMS, TRITON, norm_launch.add_rms_norm_triton, accepts=norm_launch.accepts_add,
                  available=norm_launch.available)
REGISTRY.register(GATED_RMS, TORCH, torch_ref.gated_rms_norm_torch)
REGISTRY.register(GATED_RMS, TRITON, norm_launch.gated_rms_norm_triton, accepts=norm_launch.accepts_gated,
                  available=norm_launch.available)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., W]; weight [W] -> [..., W] in promote_types(weight.dtype, x.dtype)."""
    return dispatch(RMS, x, weight, eps, device=x.device)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: (s, rms_norm(s)) with s = x + residual [..., W] in x's dtype;
    on CUDA one launch."""
    return dispatch(ADD_RMS, x, residual, weight, eps, device=x.device)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., W]; weight [W] -> [..., W] in x.dtype."""
    return dispatch(GATED_RMS, x, gate, weight, eps, device=x.device)
