"""What one forward pass hands every layer: the pack's metadata, the caches and pass options."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3verify.serving.batch import PackedBatch
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.state_cache import KDAStatePool


@dataclass
class ForwardContext:
    batch: PackedBatch
    kv_cache: PagedLatentCache | None = None  # None: attend to this pack only, cache nothing
    state_pool: KDAStatePool | None = None  # None: zero initial state, final state dropped
    segment_len: int | None = None  # KDA prefill in segments of this many tokens (multiple of 64)
    mla_absorb: bool = True  # decode attends in the latent space (q . W_kb against c)
    kv_rows: torch.Tensor | None = None  # [T] latent-cache rows of the pack's tokens (set by the model)
    stats: dict[str, int] = field(default_factory=dict)  # engagement counters for checks

    def bump(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1
