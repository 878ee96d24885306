"""The score arena: scratch that a score pass writes and a commit reads, and nothing else.

Per KDA layer, the state and the q/k/v conv windows after each of the n = k+1 positions of every row;
per MLA layer, the latents that the score pass is about to overwrite (so a commit can put back the
rows of rejected positions). The caches are never written by the KDA side of a score: the pool holds
the pre-score state until `commit_accepted` copies the accepted position's record into it.

state   [kda_layers, rows, n, heads, dk, dv] fp32
conv    [kda_layers, rows, n, 3, kda_dim, W-1] fp32 (q, k, v windows)
latents [mla_layers, rows * n, width] in the cache dtype
Allocated with torch.empty: `poison()` fills it with NaN, so a record read before it was written shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3verify.config import ModelConfig
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.state_cache import KDAStatePool


class ScoreArena:
    def __init__(self, cfg: ModelConfig, max_rows: int, num_positions: int, cache_dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if max_rows < 1 or num_positions < 2:
            raise ValueError(f"a score arena needs max_rows >= 1 and num_positions >= 2 (one token plus at least "
                             f"one draft); got {max_rows}, {num_positions}")
        self.max_rows, self.num_positions = max_rows, num_positions
        self.kda_index = {layer: i for i, layer in enumerate(cfg.kda_layers)}
        h, dk, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.conv_kernel_size
        n, f32 = num_positions, torch.float32
        self.state = torch.empty(len(self.kda_index), max_rows, n, h, dk, dk, dtype=f32, device=device)
        self.conv = torch.empty(len(self.kda_index), max_rows, n, 3, D, W - 1, dtype=f32, device=device)
        self.latents = torch.empty(len(cfg.full_attn_layers), max_rows * n, cfg.mla_cache_width, dtype=cache_dtype,
                                   device=device)

    def poison(self) -> None:
        for t in (self.state, self.conv, self.latents):
            t.fill_(float("nan"))

    def records(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One KDA layer's (state [rows, n, h, dk, dv], conv [rows, n, 3, D, W-1]) records, contiguous views."""
        if rows > self.max_rows:
            raise ValueError(f"{rows} score rows exceed the arena's {self.max_rows}")
        i = self.kda_index[layer]
        return self.state[i, :rows], self.conv[i, :rows]

    def save_latents(self, cache: PagedLatentCache, rows: torch.Tensor) -> None:
        """Keep what the cache holds at `rows` [T] (every MLA layer) before a score overwrites it."""
        if rows.numel() > self.latents.shape[1]:
            raise ValueError(f"{rows.numel()} latent rows exceed the arena's {self.latents.shape[1]}")
        flat = cache.data.view(cache.data.shape[0], -1, cache.width)
        self.latents[:, : rows.numel()] = flat.index_select(1, rows)


@dataclass(frozen=True)
class ScorePass:
    """What a score forward hands the layers (ForwardContext.score)."""

    arena: ScoreArena
    num_positions: int  # n = k + 1 tokens per sequence: the last accepted token and k drafts
    fused: bool = False  # one-launch Triton score per KDA layer (--kda-fused-score)


def commit_accepted(pool: KDAStatePool | None, cache: PagedLatentCache | None, arena: ScoreArena,
                    slots: torch.Tensor, accepted: torch.Tensor, latent_rows: torch.Tensor | None) -> None:
    """Make the accepted prefix the truth, with no host synchronisation.

    slots [B] state slots of the scored rows; accepted [B] int64 in 0..n-1 (drafts accepted: position
    accepted[b] is the last one kept); latent_rows [B * n] the cache rows the score wrote (row-major by
    sequence). KDA: record[accepted] -> the pool's state and windows. MLA: rows of positions past
    accepted get back what they held before the score."""
    B, n = slots.numel(), arena.num_positions
    rows = torch.arange(B, device=slots.device)
    if pool is not None and arena.kda_index:
        pool.state[:, slots] = arena.state[:, rows, accepted]
        windows = arena.conv[:, rows, accepted]  # [L, B, 3, D, W-1]
        for c, t in enumerate((pool.conv_q, pool.conv_k, pool.conv_v)):
            t[:, slots] = windows[:, :, c]
    if cache is not None and latent_rows is not None and arena.latents.shape[0]:
        flat = cache.data.view(cache.data.shape[0], -1, cache.width)
        rejected = (torch.arange(n, device=slots.device)[None, :] > accepted[:, None]).reshape(-1)
        written = flat.index_select(1, latent_rows)
        flat[:, latent_rows] = torch.where(rejected[None, :, None], arena.latents[:, : B * n], written)
