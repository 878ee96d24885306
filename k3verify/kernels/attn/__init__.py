"""Causal attention (MLA prefill) of one sequence, or of a packed batch in one call: eager torch reference;
fused SDPA on CUDA.

CPU runs the reference; CUDA runs SDPA when it accepts the call, else the reference with a logged
reason (kernels/registry.py)."""

from __future__ import annotations

import torch

from k3verify.kernels.attn import packed, sdpa, torch_ref
from k3verify.kernels.registry import CUDA, REGISTRY, TORCH, dispatch
from k3verify.kernels.varlen import DeviceSeqlens

CAUSAL = "attn.causal"
CAUSAL_PACKED = "attn.causal_packed"
CAUSAL_STATIC = "attn.causal_static"

REGISTRY.register(CAUSAL, TORCH, torch_ref.causal_attention)
REGISTRY.register(CAUSAL, CUDA, sdpa.causal_attention_sdpa, accepts=sdpa.accepts)
REGISTRY.register(CAUSAL_PACKED, TORCH, packed.causal_attention_packed_torch)
REGISTRY.register(CAUSAL_PACKED, CUDA, packed.causal_attention_packed_sdpa, accepts=packed.accepts)
REGISTRY.register(CAUSAL_STATIC, TORCH, packed.causal_attention_static_torch)
REGISTRY.register(CAUSAL_STATIC, CUDA, packed.causal_attention_static_sdpa, accepts=packed.accepts_static)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """q [h, Lq, d], k [h, Lk, d], v [h, Lk, dv] -> [h, Lq, dv]; query t sees keys 0..offset+t."""
    return dispatch(CAUSAL, q, k, v, offset, scale, device=q.device)


def causal_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cu: list[int],
                            ranges: list[tuple[int, int, int]], scale: float) -> torch.Tensor:
    """q [Tq, h, d], k [Tk, h, d], v [Tk, h, dv] packed; sequence i: queries q_cu[i]:q_cu[i+1], keys
    ranges[i] = (k0, k1, offset) with query t seeing keys k0..k0+offset+t -> [Tq, h, dv]."""
    return dispatch(CAUSAL_PACKED, q, k, v, q_cu, ranges, scale, device=q.device)


def causal_attention_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: DeviceSeqlens,
                            seg_ids: torch.Tensor, local_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """A static pack (kernels/varlen.py) of fresh sequences: q, k [T, h, d], v [T, h, dv], the keys being the
    queries; token t is offset local_pos[t] of sequence seg_ids[t] -> [T, h, dv]. On CUDA no host value but the
    bucket's bounds (CUDA-graph capturable); the reference reads the offsets back."""
    return dispatch(CAUSAL_STATIC, q, k, v, seqlens, seg_ids, local_pos, scale, device=q.device)
