"""Block Attention Residuals (K3): softmax-weighted mix of the block entries and the running sum.

mix(p, B): V = [B_0 .. B_{n-1}, p] in fp32; K = V * rsqrt(mean(V^2) + eps) (no weight);
score = K . (norm.weight * proj.weight); alpha = softmax over the n+1 sources; out = sum alpha V
(the raw V), cast back. No 1/sqrt(d). Computed source by source so no [T, n+1, H] fp32 copy exists.

The block entries live in one buffer per forward pass, [tokens, max_blocks, H], preallocated and
handed to the mix as the narrowed view [:, :n] (the unused columns would otherwise join the softmax).
Nothing is cached across passes: decode builds a fresh (small) buffer each step.
"""

from __future__ import annotations

import torch

from k3verify.config import ModelConfig


def num_blocks(cfg: ModelConfig) -> int:
    """Entries appended over one pass: one at every layer l with l % block_size == 0."""
    assert cfg.attn_res_block_size is not None
    return -(-cfg.num_hidden_layers // cfg.attn_res_block_size)


def _score(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """v [T, H] fp32 -> [T]."""
    k = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (k * w).sum(dim=-1)


def attn_res_mix(p: torch.Tensor, blocks: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """p [T, H]; blocks [T, n, H] (n >= 1; a narrowed view is fine) -> [T, H] in p's dtype."""
    w = norm_weight.float() * proj_weight.float().reshape(-1)
    n = blocks.shape[1]
    scores = torch.stack([_score(blocks[:, i].float(), w, eps) for i in range(n)] + [_score(p.float(), w, eps)],
                         dim=-1)
    alpha = torch.softmax(scores, dim=-1)  # [T, n+1]
    out = alpha[:, 0, None] * blocks[:, 0].float()  # sources summed in order B_0 .. B_{n-1}, p
    for i in range(1, n):
        out = out + alpha[:, i, None] * blocks[:, i].float()
    return (out + alpha[:, n, None] * p.float()).to(p.dtype)


class BlockBuffer:
    """Per-pass block list: preallocated [tokens, max_blocks, H]; `view()` is the narrowed [:, :n]."""

    def __init__(self, tokens: int, max_blocks: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.empty(tokens, max_blocks, hidden, dtype=dtype, device=device)
        self.n = 0

    def append(self, p: torch.Tensor) -> None:
        if self.n == self.data.shape[1]:
            raise RuntimeError(f"block buffer full ({self.n} entries); the layer count and block size disagree")
        self.data[:, self.n] = p
        self.n += 1

    def view(self) -> torch.Tensor:
        return self.data[:, : self.n]


class ConcatBlocks:
    """The naive list of entries, restacked on every read (reference for the preallocated buffer)."""

    def __init__(self) -> None:
        self.entries: list[torch.Tensor] = []

    @property
    def n(self) -> int:
        return len(self.entries)

    def append(self, p: torch.Tensor) -> None:
        self.entries.append(p)

    def view(self) -> torch.Tensor:
        return torch.stack(self.entries, dim=1)
