"""MXFP4 expert weights: decode to dense (`dequantize`, for the cached / per-use expert modes) and the
grouped GEMM that reads them packed (`grouped_mm`, the packed mode). Independent of checkpoint/mxfp4.py,
which is the reference decode the gates compare against.

`grouped_mm`: the torch reference dequantizes each expert that has rows and runs one F.linear; on CUDA a
Triton kernel decodes E2M1 x E8M0 in registers (bf16 activations, fp32 accumulation, no host sync), or
the reference runs with a logged reason (kernels/registry.py).
"""

from __future__ import annotations

import torch

from k3verify.kernels.mxfp4 import grouped_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, dispatch

DEQUANT = "mxfp4.dequant"
GROUPED_MM = "mxfp4.grouped_mm"

REGISTRY.register(DEQUANT, TORCH, torch_ref.dequantize_torch)
REGISTRY.register(GROUPED_MM, TORCH, torch_ref.grouped_mm_torch)
REGISTRY.register(GROUPED_MM, TRITON, grouped_launch.grouped_mm_triton, accepts=grouped_launch.accepts,
                  available=grouped_launch.available)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """[out, in/2] uint8 + [out, in/group] uint8 E8M0 -> [out, in] in `dtype` (exact for fp32/bf16)."""
    return dispatch(DEQUANT, packed, scale, dtype, group_size, device=packed.device)


def grouped_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor,
               group: int) -> torch.Tensor:
    """x [M, K] (rows sorted by expert), codes [E, N, K/2], scales [E, N, K/group], offs [E] int32 ends
    -> [M, N] in x.dtype. See torch_ref.grouped_mm_torch."""
    return dispatch(GROUPED_MM, x, codes, scales, offs, group, device=x.device)
