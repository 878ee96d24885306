"""Tensor-parallel layers: the single-process layers built at this rank's width, with a row-parallel output
projection (RowParallelLinear, their `out_linear` part) whose one collective makes their output whole.

KDA and MLA are built from `local_config` (this rank's heads): every head-wise projection, conv, gate and
bias holds the rank's head slice, o_proj the matching input columns, so o_proj's GEMM is a partial
sum over heads and one all-reduce completes it. The MLA latent ([c | k_rot], shared by every head) is
computed whole on every rank, so each rank's latent cache holds the full latent. The dense MLP splits its
intermediate columns the same way. The vocabulary is split by rows: the embedding looks up the ids this
rank owns (zeros elsewhere) and all-reduces; lm_head computes this rank's logit columns and all-gathers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from k3verify.config import ModelConfig
from k3verify.serving.layers.kda import KimiDeltaAttention
from k3verify.serving.layers.linear import LinearFactory
from k3verify.serving.layers.mla import MultiHeadLatentAttention
from k3verify.serving.layers.mlp import GatedMLP
from k3verify.serving.parallel.comm import Comm
from k3verify.serving.parallel.layout import split_range


class RowParallelLinear(nn.Module):
    """A projection over this rank's input columns (its heads' or intermediate columns): the GEMM gives a partial
    sum, one all-reduce makes it whole. The output projection of a head- or column-split layer (o_proj, down_proj),
    which the plain layer takes as its `out_linear` part."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> None:
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype, device=device), requires_grad=False)
        self.comm = comm

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (what the all-reduce sums)."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.partial_sum(x))


def row_parallel(comm: Comm) -> LinearFactory:
    """The out_linear part of a layer split over `comm`'s tensor-parallel ranks."""
    return functools.partial(RowParallelLinear, comm=comm)


def tp_attention(local: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> KimiDeltaAttention | MultiHeadLatentAttention:
    """The plain KDA or MLA layer over this rank's heads (local: the rank's config), o_proj row-parallel."""
    if local.layer_kind(layer_idx) == "kda":
        # K3 pads A_log to a power of two of the GLOBAL head count; a rank holds exactly its heads' slice.
        return KimiDeltaAttention(local, layer_idx, dtype, device, out_linear=row_parallel(comm),
                                  a_log_width=local.kda_num_heads)
    return MultiHeadLatentAttention(local, layer_idx, dtype, device, out_linear=row_parallel(comm))


def tp_mlp(cfg: ModelConfig, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str | None,
           tile_tokens: int | None, comm: Comm) -> GatedMLP:
    """The plain gated MLP over this rank's intermediate columns, down_proj row-parallel."""
    lo, hi = comm.layout.tp_range(intermediate)
    return GatedMLP(cfg, hidden, hi - lo, dtype, device, tile_tokens, out_linear=row_parallel(comm))


def vocab_sizes(vocab: int, comm: Comm) -> list[int]:
    """Rows of the vocabulary each rank holds, in rank order."""
    return [b - a for a, b in (split_range(vocab, comm.world, r) for r in range(comm.world))]


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [first, first + n) of the embedding table (layers/embed.Embedding's `weight`, split)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> None:
        super().__init__()
        self.first, stop = comm.layout.tp_range(vocab)
        self.weight = nn.Parameter(torch.empty(stop - self.first, hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.comm.all_reduce(rows.masked_fill(~mine[:, None], 0))


class VocabParallelLMHead(nn.Module):
    """This rank's logit columns (layers/embed.LMHead's GEMM over this rank's rows of `weight`); every rank ends
    with the whole [N, V] fp32 logits."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device | str | None,
                 comm: Comm) -> None:
        super().__init__()
        first, stop = comm.layout.tp_range(vocab)
        self.comm, self.sizes = comm, vocab_sizes(vocab, comm)
        self.weight = nn.Parameter(torch.empty(stop - first, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(F.linear(h, self.weight).float(), self.sizes, dim=-1)
