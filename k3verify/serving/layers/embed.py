"""Token embedding and the output head (untied: lm_head is its own matrix in this family)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, V] (the GEMM runs in the model dtype)."""
        return F.linear(h, self.weight).float()
