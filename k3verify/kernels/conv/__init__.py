"""Packed causal depthwise conv + SiLU with per-sequence windows (KDA's q/k/v short convs).

Only a torch implementation is registered: the gather form is already one fused pass per tap on
CUDA, and a fast path gets a routing test when it is added.
"""

from __future__ import annotations

import torch

from k3verify.kernels.conv import torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, dispatch

CAUSAL = "conv.causal"

REGISTRY.register(CAUSAL, TORCH, torch_ref.causal_conv_varlen_torch)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, seg_ids: torch.Tensor, local_pos: torch.Tensor,
                cu_seqlens: torch.Tensor, initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """See torch_ref.causal_conv_varlen_torch."""
    return dispatch(CAUSAL, x, weight, seg_ids, local_pos, cu_seqlens, initial, device=x.device)
