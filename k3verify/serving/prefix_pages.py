"""The paged MLA latent cache with pages shared by reference count: a cached prefix's pages are held by the prefix
cache and by every sequence that resumed from it, and go back to the free list only when the last holder lets go.

A sequence's table starts with the shared pages of its cached prefix, then fresh pages. A page is written only by
the sequence whose positions it holds; a shared page that a sequence would write into (the partial last page of a
whole-prompt entry, where the first decode lands) is copied first: `copy_on_write` gives that sequence its own
page with the same rows and drops its reference to the shared one.
"""

from __future__ import annotations

from collections import Counter

import torch

from k3verify.config import ModelConfig
from k3verify.serving.batch import SCRATCH
from k3verify.serving.kv_cache import CacheError, PagedLatentCache


class SharedLatentCache(PagedLatentCache):
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(cfg, num_pages, page_size, dtype, device)
        self.refs: Counter[int] = Counter()  # page -> holders (sequence tables and prefix-cache entries)
        self.held: Counter[int] = Counter()  # page -> references the prefix cache holds
        self.num_copied = 0  # pages copied on write

    def reserve(self, seq_id: int, num_tokens: int, shared: list[int] | None = None) -> None:
        """Give sequence `seq_id` a table for `num_tokens` tokens: `shared` (pages of a cached prefix, in order,
        each gaining a reference) first when the sequence is new, then fresh pages."""
        if shared:
            if seq_id in self._tables:
                raise CacheError(f"sequence {seq_id} already holds pages; shared pages go first in a new table")
            bad = [p for p in shared if self.refs[p] < 1]
            if bad:
                raise CacheError(f"sequence {seq_id}: shared page(s) {bad} are held by no one (freed or never used)")
            if len(shared) > self.pages_needed(num_tokens):
                raise CacheError(f"sequence {seq_id}: {len(shared)} shared pages exceed the {num_tokens} tokens")
        before = list(self._tables.get(seq_id, ()))
        self._tables[seq_id] = before + list(shared or ())
        try:
            super().reserve(seq_id, num_tokens)
        except CacheError:
            if before:
                self._tables[seq_id] = before
            else:
                self._tables.pop(seq_id, None)
            raise
        for p in self._tables[seq_id][len(before):]:
            self.refs[p] += 1

    def free(self, seq_id: int) -> None:
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise CacheError(f"sequence {seq_id} holds no pages")
        self._drop(table)

    def hold(self, pages: list[int]) -> None:
        """The prefix cache takes a reference to pages a sequence filled."""
        bad = [p for p in pages if self.refs[p] < 1]
        if bad:
            raise CacheError(f"page(s) {bad} are held by no one: the prefix cache cannot keep them")
        for p in pages:
            self.refs[p] += 1
            self.held[p] += 1

    def unhold(self, pages: list[int]) -> None:
        """The prefix cache lets go of pages (an entry evicted); a page nobody else holds is free again."""
        bad = [p for p in pages if self.held[p] < 1]
        if bad:
            raise CacheError(f"page(s) {bad} are not held by the prefix cache")
        for p in pages:
            self.held[p] -= 1
            if not self.held[p]:
                del self.held[p]
        self._drop(pages)

    def _drop(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                del self.refs[p]
                self._free.append(p)

    def copy_on_write(self, seq_id: int, index: int) -> int:
        """Make the `index`-th page of the sequence's table its own before it writes there; returns the page."""
        table = self._tables.get(seq_id)
        if table is None or not 0 <= index < len(table):
            raise CacheError(f"sequence {seq_id} has no page #{index}")
        page = table[index]
        if self.refs[page] == 1:
            return page
        if not self._free:
            raise CacheError(f"sequence {seq_id}: no free page to copy shared page {page} into")
        new = self._free.popleft()
        self.data[:, new].copy_(self.data[:, page])
        table[index] = new
        self.refs[new] += 1
        self._drop([page])
        self.num_copied += 1
        return new

    def num_shared_pages(self) -> int:
        return sum(1 for n in self.refs.values() if n > 1)

    def check_integrity(self) -> None:
        counted: Counter[int] = Counter(p for t in self._tables.values() for p in t) + self.held
        free = list(self._free)
        problems = []
        if counted != self.refs:
            wrong = sorted(p for p in set(counted) | set(self.refs) if counted[p] != self.refs[p])
            problems.append(f"page reference counts disagree with the holders at page(s) {wrong[:8]}")
        if any(len(set(t)) != len(t) for t in self._tables.values()):
            problems.append("a sequence holds a page twice")
        if len(set(free)) != len(free):
            problems.append("free list holds duplicates")
        if set(counted) & set(free):
            problems.append(f"page(s) {sorted(set(counted) & set(free))[:8]} both free and held")
        if SCRATCH in counted or SCRATCH in free:
            problems.append(f"scratch page {SCRATCH} was handed out")
        if set(counted) | set(free) != set(range(1, self.num_pages)):
            lost = sorted(set(range(1, self.num_pages)) - set(counted) - set(free))
            problems.append(f"page(s) lost or out of range: missing {lost[:8]}")
        if problems:
            raise CacheError("latent cache integrity: " + "; ".join(problems))
