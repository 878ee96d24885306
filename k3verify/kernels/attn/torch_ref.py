"""Causal softmax attention of one sequence, eager: the reference order of the serving MLA prefill."""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """q [h, Lq, d], k [h, Lk, d], v [h, Lk, dv]; query t sees keys 0..offset+t. Eager order:
    scores in the activation dtype, softmax in fp32, cast back, then P @ V."""
    Lq, Lk = q.shape[1], k.shape[1]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale
    allowed = torch.arange(Lk, device=q.device)[None, :] <= (torch.arange(Lq, device=q.device)[:, None] + offset)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
