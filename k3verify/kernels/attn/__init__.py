"""Causal attention of one sequence (MLA prefill): eager torch reference; fused SDPA on CUDA.

CPU runs the reference; CUDA runs SDPA when it accepts the call, else the reference with a logged
reason (kernels/registry.py)."""

from __future__ import annotations

import torch

from k3verify.kernels.attn import sdpa, torch_ref
from k3verify.kernels.registry import CUDA, REGISTRY, TORCH, dispatch

CAUSAL = "attn.causal"

REGISTRY.register(CAUSAL, TORCH, torch_ref.causal_attention)
REGISTRY.register(CAUSAL, CUDA, sdpa.causal_attention_sdpa, accepts=sdpa.accepts)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """q [h, Lq, d], k [h, Lk, d], v [h, Lk, dv] -> [h, Lq, dv]; query t sees keys 0..offset+t."""
    return dispatch(CAUSAL, q, k, v, offset, scale, device=q.device)
