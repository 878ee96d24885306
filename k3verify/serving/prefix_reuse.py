"""The prefix cache as the runner uses it: admit a prompt at the deepest cached position, snapshot where its
prefill stops, and keep what its prefill made for the requests after it.

Admission looks the prompt up (serving/prefix_cache.py); a hit gives the sequence the cached prefix's MLA pages
(shared, serving/prefix_pages.py), copies the KDA snapshot into its state slot and counts those tokens as cached,
so the scheduler prefills only the rest, cut at the planned snapshot positions (all on the block grid, so the
chunked KDA recurrence and every GEMM row round as in a cold prefill on the CPU). A whole-prompt hit prefills
nothing: its first token is sampled from the logits the entry kept. After each prefill the sequence's state at a
planned position (or at its prompt's end, with the last logits) is copied out and recorded.

Entries are keyed under a root naming the served weights: a parameter written in place (copy_ bumps its version)
or moved gives a new root, so nothing cached before a weight reload is ever found after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.prefix_cache import PrefixCache
from k3verify.serving.prefix_hash import root_hash
from k3verify.serving.prefix_pages import SharedLatentCache
from k3verify.serving.prefix_snapshots import restore, snapshot_bytes, take
from k3verify.serving.state_cache import KDAStatePool

BLOCK = 64  # the KDA chunk: the finest grid a resumed prefill rounds exactly on
GRID = 512  # a snapshot every this many tokens of a prompt besides the junctions, last blocks and ends
DEFAULT_SNAPSHOTS = 64  # snapshots (of a slot's state and windows, with a logits row) the default budget holds


@dataclass(frozen=True)
class PrefixSettings:
    """How the engine caches prefixes: the snapshot budget (in snapshots, or in bytes when budget_bytes is set),
    the sparse grid, and whether entries are isolated per API key."""

    snapshots: int = DEFAULT_SNAPSHOTS
    budget_bytes: int | None = None
    grid: int = GRID
    per_key: bool = False


@dataclass(frozen=True)
class Resume:
    """Where an admitted prompt starts: `position` tokens came from the cache (with their `logits` when that is the
    whole prompt), `points` are where its prefill stops to snapshot, `reason` is the hit or miss reason."""

    position: int
    points: tuple[int, ...]
    logits: torch.Tensor | None
    reason: str


class ModelRunnerLike(Protocol):
    """What PrefixReuse needs of the runner (serving/runner.py ModelRunner)."""

    kv_cache: PagedLatentCache

    def admit(self, seq_id: int, num_tokens: int, shared: list[int] | None = None, cached: int = 0,
              cuts: tuple[int, ...] = ()) -> None: ...

    def cuts_of(self, seq_id: int) -> tuple[int, ...]: ...

    def slot_of(self, seq_id: int) -> int: ...

    def own_page(self, seq_id: int, index: int) -> None: ...


class PrefixReuse:
    def __init__(self, kv: SharedLatentCache, pool: KDAStatePool, params: Sequence[torch.Tensor], weights: str,
                 vocab_size: int, settings: PrefixSettings) -> None:
        self.pool, self.params, self.weights, self.settings = pool, list(params), weights, settings
        self.vocab_size = vocab_size
        self.one_snapshot = snapshot_bytes(pool, vocab_size)
        budget = settings.budget_bytes if settings.budget_bytes is not None else settings.snapshots * self.one_snapshot
        self.cache = PrefixCache(kv, block=BLOCK, grid=settings.grid, budget_bytes=budget)
        self._keys: dict[int, tuple[list[int], bytes, tuple[int, ...]]] = {}  # seq -> prompt, root, points

    def weights_stamp(self) -> str:
        """The served weights as they stand: the digest they were loaded from, and every parameter's storage and
        version (a write in place or a move changes it)."""
        h = hashlib.blake2b(self.weights.encode(), digest_size=16)
        for p in self.params:
            h.update(f"{p.data_ptr()}:{p._version};".encode())
        return h.hexdigest()

    def root(self, key: str | None) -> bytes:
        return root_hash(self.weights_stamp(), 0, key if self.settings.per_key else None)

    def admit(self, runner: ModelRunnerLike, seq_id: int, num_tokens: int, prompt: list[int],
              key: str | None) -> Resume:
        """Admit `seq_id` for `num_tokens` tokens at the deepest cached position of `prompt`."""
        root = self.root(key)
        hit = self.cache.lookup(prompt, root)
        try:
            cuts = hit.snapshot.cuts if hit.snapshot is not None else ()
            runner.admit(seq_id, num_tokens, shared=hit.pages, cached=hit.position, cuts=cuts)
            if hit.snapshot is not None:
                restore(hit.snapshot, self.pool, runner.slot_of(seq_id))
            page = self.cache.kv.page_size
            if hit.position % page:  # the first write lands in the entry's partial last page: make it ours
                runner.own_page(seq_id, hit.position // page)
        finally:
            self.cache.release(hit)
        points = tuple(self.cache.snapshot_positions(len(prompt), hit))
        self._keys[seq_id] = (prompt, root, points)
        logits = hit.snapshot.logits if hit.whole and hit.snapshot is not None else None
        return Resume(hit.position, points, logits, hit.reason)

    def after_prefill(self, runner: ModelRunnerLike, chunks: Sequence[tuple[int, int, bool]],
                      logits: torch.Tensor) -> None:
        """Record the state of each (seq_id, end, is_last) chunk just prefilled (row i of `logits` is its last
        token's) where its plan wants one: at a planned position, and at its prompt's end with that row."""
        for i, (seq_id, end, is_last) in enumerate(chunks):
            known = self._keys.get(seq_id)
            if known is None:
                continue
            prompt, root, points = known
            slot, table, cuts = runner.slot_of(seq_id), runner.kv_cache.table(seq_id), runner.cuts_of(seq_id)
            if end in points or (is_last and end % BLOCK == 0):
                self.cache.insert(prompt, root, end, table, take(self.pool, slot, end, cuts=cuts))
            if is_last:
                self.cache.insert(prompt, root, end, table, take(self.pool, slot, end, logits[i], cuts))
                del self._keys[seq_id]

    def forget(self, seq_id: int) -> None:
        self._keys.pop(seq_id, None)

    def make_room(self, pages: int) -> None:
        """Evict unpinned cached entries until `pages` pages are free (or nothing cached is left to evict)."""
        if self.cache.kv.num_free_pages < pages:
            self.cache.evict_pages(pages)
