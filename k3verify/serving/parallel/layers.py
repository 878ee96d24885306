"""Tensor-parallel versions of the single-process layers: the same modules built at this rank's width,
plus the one collective that makes their output whole.

KDA and MLA are built from `local_config` (this rank's heads): every head-wise projection, conv, gate and
bias holds the rank's head slice, o_proj the matching input columns, so the layer's output is a partial
sum over heads and one all-reduce completes it. The MLA latent ([c | k_rot], shared by every head) is
computed whole on every rank, so each rank's latent cache holds the full latent. The dense MLP splits its
intermediate columns the same way. The vocabulary is split by rows: the embedding looks up the ids this
rank owns (zeros elsewhere) and all-reduces; lm_head computes this rank's logit columns and all-gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3verify.config import ModelConfig
from k3verify.serving.context import ForwardContext
from k3verify.serving.layers.embed import Embedding, LMHead
from k3verify.serving.layers.kda import KimiDeltaAttention
from k3verify.serving.layers.mla import MultiHeadLatentAttention
from k3verify.serving.layers.mlp import GatedMLP
from k3verify.serving.parallel.comm import Comm
from k3verify.serving.parallel.layout import split_range


class TPKimiDeltaAttention(KimiDeltaAttention):
    """KDA over this rank's heads (cfg is the rank's local config); the output is all-reduced."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> None:
        super().__init__(cfg, layer_idx, dtype, device)
        self.comm = comm
        if cfg.is_k3:
            # K3 pads A_log to a power of two of the GLOBAL head count; a rank holds exactly its heads' slice.
            self.A_log = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        partial = super().forward(x, ctx)  # o_proj over this rank's heads only
        return self.comm.all_reduce(partial)


class TPMultiHeadLatentAttention(MultiHeadLatentAttention):
    """MLA over this rank's heads (cfg is the rank's local config); the output is all-reduced."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> None:
        super().__init__(cfg, layer_idx, dtype, device)
        self.comm = comm

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x, ctx))


class TPGatedMLP(GatedMLP):
    """A gated MLP over this rank's intermediate columns; the down projection's partial sum is all-reduced."""

    def __init__(self, cfg: ModelConfig, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device | str | None, tile_tokens: int | None, comm: Comm) -> None:
        lo, hi = comm.layout.tp_range(intermediate)
        super().__init__(cfg, hidden, hi - lo, dtype, device, tile_tokens)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().forward(x))


def vocab_sizes(vocab: int, comm: Comm) -> list[int]:
    """Rows of the vocabulary each rank holds, in rank order."""
    return [b - a for a, b in (split_range(vocab, comm.world, r) for r in range(comm.world))]


class VocabParallelEmbedding(Embedding):
    """This rank's rows [first, first + n) of the embedding table."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> None:
        self.first, stop = comm.layout.tp_range(vocab)
        super().__init__(stop - self.first, hidden, dtype, device)
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.comm.all_reduce(rows.masked_fill(~mine[:, None], 0))


class VocabParallelLMHead(LMHead):
    """This rank's logit columns; every rank ends with the whole [N, V] fp32 logits."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> None:
        first, stop = comm.layout.tp_range(vocab)
        super().__init__(hidden, stop - first, dtype, device)
        self.comm, self.sizes = comm, vocab_sizes(vocab, comm)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(super().forward(h), self.sizes, dim=-1)
