"""KDA state pool: per sequence slot, the fp32 recurrent state and the q/k/v conv windows of every
KDA layer.

state  [kda_layers, slots, heads, dk, dv] fp32
conv_q / conv_k / conv_v  [kda_layers, slots, kda_dim, W-1] fp32 (inputs are bf16/fp32: stored exactly)
Slot SCRATCH (0) is reserved: padded rows of a batch park there and it is never handed out.
"""

from __future__ import annotations

from collections import deque

import torch

from k3verify.config import ModelConfig
from k3verify.serving.batch import SCRATCH
from k3verify.serving.kv_cache import CacheError


class KDAStatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (the scratch slot comes on top); got {num_slots}")
        self.cfg = cfg
        self.num_slots = num_slots
        self.layer_index = {layer: i for i, layer in enumerate(cfg.kda_layers)}
        L, n = len(self.layer_index), num_slots + 1
        h, dk, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.conv_kernel_size
        dv = dk  # KDA values share the head dim
        f32 = torch.float32
        self.state = torch.zeros(L, n, h, dk, dv, dtype=f32, device=device)
        self.conv_q = torch.zeros(L, n, D, W - 1, dtype=f32, device=device)
        self.conv_k = torch.zeros(L, n, D, W - 1, dtype=f32, device=device)
        self.conv_v = torch.zeros(L, n, D, W - 1, dtype=f32, device=device)
        self._free: deque[int] = deque(range(1, n))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> frozenset[int]:
        return frozenset(self._used)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"state": self.state, "conv_q": self.conv_q, "conv_k": self.conv_k, "conv_v": self.conv_v}

    def allocate(self) -> int:
        if not self._free:
            raise CacheError(f"no free KDA state slot (all {self.num_slots} in use)")
        slot = self._free.popleft()
        self._used.add(slot)
        for t in self.tensors().values():
            t[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise CacheError(f"KDA state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        free = list(self._free)
        usable = set(range(1, self.num_slots + 1))
        problems = []
        if len(set(free)) != len(free):
            problems.append("free list holds duplicates")
        if set(free) & self._used:
            problems.append(f"slot(s) {sorted(set(free) & self._used)} both free and used")
        if SCRATCH in self._used or SCRATCH in free:
            problems.append(f"scratch slot {SCRATCH} was handed out")
        if set(free) | self._used != usable:
            problems.append(f"slot(s) lost or out of range: {sorted(usable ^ (set(free) | self._used))}")
        used = sorted(self._used - {SCRATCH})
        if used:
            idx = torch.tensor(used, device=self.state.device)
            for name, t in self.tensors().items():
                bad = ~torch.isfinite(t.index_select(1, idx)).flatten(2).all(dim=-1)  # [layers, used]
                if bad.any():
                    li, si = bad.nonzero()[0].tolist()
                    problems.append(f"{name} of slot {used[si]} (kda layer #{li}) is not finite")
        if problems:
            raise CacheError("KDA state pool integrity: " + "; ".join(problems))

    # ---- per-layer views used by the KDA layer ----
    def windows(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        i = self.layer_index[layer]
        return tuple(t[i].index_select(0, slots).to(dtype) for t in (self.conv_q, self.conv_k, self.conv_v))

    def conv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's q/k/v windows [slots, kda_dim, W-1] fp32, as views: the decode conv updates them in place."""
        i = self.layer_index[layer]
        return self.conv_q[i], self.conv_k[i], self.conv_v[i]

    def store_windows(self, layer: int, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        i = self.layer_index[layer]
        for t, w in ((self.conv_q, q), (self.conv_k, k), (self.conv_v, v)):
            t[i].index_copy_(0, slots, w.float())

    def state_view(self, layer: int) -> torch.Tensor:
        """One KDA layer's states [slots, heads, dk, dv] (a contiguous view the decode kernel updates in place)."""
        return self.state[self.layer_index[layer]]

    def read_state(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.state[self.layer_index[layer]].index_select(0, slots)

    def store_state(self, layer: int, slots: torch.Tensor, value: torch.Tensor) -> None:
        self.state[self.layer_index[layer]].index_copy_(0, slots, value.float())
