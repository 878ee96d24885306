"""MXFP4 expert weights -> dense, for the serving experts (independent of checkpoint/mxfp4.py,
which is the reference decode the gates compare against)."""

from __future__ import annotations

import torch

from k3verify.kernels.mxfp4 import torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, dispatch

DEQUANT = "mxfp4.dequant"

REGISTRY.register(DEQUANT, TORCH, torch_ref.dequantize_torch)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """[out, in/2] uint8 + [out, in/group] uint8 E8M0 -> [out, in] in `dtype` (exact for fp32/bf16)."""
    return dispatch(DEQUANT, packed, scale, dtype, group_size, device=packed.device)
