"""What one forward pass hands every layer: the pack's metadata, the caches and pass options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from k3verify.serving.batch import PackedBatch
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.state_cache import KDAStatePool

if TYPE_CHECKING:
    from k3verify.serving.spec.arena import ScorePass


@dataclass
class ForwardContext:
    batch: PackedBatch
    kv_cache: PagedLatentCache | None = None  # None: attend to this pack only, cache nothing
    state_pool: KDAStatePool | None = None  # None: zero initial state, final state dropped
    segment_len: int | None = None  # KDA prefill in segments of this many tokens (multiple of 64)
    mla_absorb: bool = True  # decode attends in the latent space (q . W_kb against c)
    kv_rows: torch.Tensor | None = None  # [T] latent-cache rows of the pack's tokens (set by the model)
    stats: dict[str, int] = field(default_factory=dict)  # engagement counters for checks
    score: ScorePass | None = None  # a speculative score pass: KDA records per position, MLA absorbed per token
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """What `make()` returns, computed once per pass: per-batch tensors every layer of a kind shares."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def fresh_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, 1] in `dtype`: 0 for a sequence with nothing cached (it starts from zero conv windows and
        state), 1 for a continuation. Computed once per pass, shared by every KDA layer."""
        return self.memo(("fresh", dtype), lambda: (self.batch.start_pos > 0).to(dtype)[:, None, None])

    def bump(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1
