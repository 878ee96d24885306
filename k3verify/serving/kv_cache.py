"""Paged MLA latent cache: per MLA layer, pages of `page_size` tokens x `[c_normed | k_rot]`.

One tensor holds every MLA layer: data[mla_layer, page, slot_in_page, width] with
width = kv_lora_rank + qk_rope_head_dim. Page SCRATCH (0) is reserved: padded page-table entries
point there, so a stray write lands in scratch and never in another sequence's page.
"""

from __future__ import annotations

from collections import deque

import torch

from k3verify.config import ModelConfig
from k3verify.serving.batch import SCRATCH


class CacheError(RuntimeError):
    """A cache operation that would corrupt state or an integrity violation."""


class PagedLatentCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 (one is the scratch page) and page_size >= 1; "
                             f"got {num_pages}, {page_size}")
        self.cfg = cfg
        self.num_pages = num_pages
        self.page_size = page_size
        self.width = cfg.mla_cache_width
        self.layer_index = {layer: i for i, layer in enumerate(cfg.full_attn_layers)}
        self.data = torch.zeros(len(self.layer_index), num_pages, page_size, self.width, dtype=dtype, device=device)
        self._free: deque[int] = deque(range(1, num_pages))
        self._tables: dict[int, list[int]] = {}

    # ---- bookkeeping (host side) ----
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def owners(self) -> frozenset[int]:
        """Sequence ids holding pages."""
        return frozenset(self._tables)

    def capacity(self, seq_id: int) -> int:
        return len(self._tables.get(seq_id, ())) * self.page_size

    def table(self, seq_id: int) -> list[int]:
        if seq_id not in self._tables:
            raise CacheError(f"sequence {seq_id} has no pages")
        return list(self._tables[seq_id])

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Grow sequence `seq_id`'s page table until it holds `num_tokens` tokens."""
        table = self._tables.setdefault(seq_id, [])
        extra = self.pages_needed(num_tokens) - len(table)
        if extra > len(self._free):
            if not table:
                del self._tables[seq_id]
            raise CacheError(f"sequence {seq_id} needs {extra} more page(s) for {num_tokens} tokens; "
                             f"{len(self._free)} free")
        for _ in range(max(0, extra)):
            table.append(self._free.popleft())

    def free(self, seq_id: int) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise CacheError(f"sequence {seq_id} holds no pages")
        self._free.extend(table)

    def check_integrity(self) -> None:
        owned = [p for t in self._tables.values() for p in t]
        free = list(self._free)
        problems = []
        if len(set(owned)) != len(owned):
            dup = sorted({p for p in owned if owned.count(p) > 1})
            problems.append(f"page(s) {dup} owned more than once")
        problems += self._free_list_problems(set(owned), free)
        if problems:
            raise CacheError("latent cache integrity: " + "; ".join(problems))

    def _free_list_problems(self, held: set[int], free: list[int]) -> list[str]:
        """What is wrong between the pages held and the free list: duplicates, a page both free and held, the
        scratch page handed out, a page neither free nor held (lost) or out of range."""
        problems = []
        if len(set(free)) != len(free):
            problems.append("free list holds duplicates")
        if held & set(free):
            problems.append(f"page(s) {sorted(held & set(free))[:8]} both free and held")
        if SCRATCH in held or SCRATCH in free:
            problems.append(f"scratch page {SCRATCH} was handed out")
        if held | set(free) != set(range(1, self.num_pages)):
            lost = sorted(set(range(1, self.num_pages)) - held - set(free))
            problems.append(f"page(s) lost or out of range: missing {lost[:8]}")
        return problems

    # ---- data (device side) ----
    def layer(self, layer: int) -> torch.Tensor:
        """[num_pages * page_size, width] view of one MLA layer (row = page * page_size + offset)."""
        return self.data[self.layer_index[layer]].view(-1, self.width)

    def rows(self, page_table: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat rows of tokens at `positions` of sequences `seq` (indices into page_table's rows)."""
        pages = page_table[seq, positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def write(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.layer(layer).index_copy_(0, rows, values.to(self.data.dtype))
