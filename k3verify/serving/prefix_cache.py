"""The prefix cache's index: which prompt prefixes are cached, where a request may resume, and what to evict.

Prompts are cut into blocks of `block` tokens (the KDA chunk grid or a multiple of it: a prefill resumed there
rounds exactly as one cut there, serving/layers/kda.py check_pieces), each named by its chained hash
(serving/prefix_hash.py), so one hash stands for the whole prefix up to its block's end. An entry is a snapshot of
the KDA state at a block's end (serving/prefix_snapshots.py) with the MLA pages of every position before it, both
from the one prefill that made them: the rows of a position depend on where that prefill was cut (the length of
the GEMMs and attention it ran in), so a snapshot never resumes over another prefill's pages. A prompt's exact end
is a whole-prompt entry (its pages, the state after the whole prompt and the logits of its last position): a
repeated prompt, however short, resumes with nothing to prefill. Every block of a cached entry's prefix is
counted, so a request knows how far it matches what is cached (its junction) even where no snapshot is.

Snapshots are kept at the junction (the end of the last full block a request shares with what is cached, where
the next request with that prefix will branch again), on a sparse grid of `grid` tokens, at the last full block
of every prompt, and at every prompt's end. Their bytes stay under `budget_bytes`: the least recently used
entry goes first, never one a request is resuming from (pinned until its admission copied it); page pressure
evicts the same way.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from k3verify.serving.prefix_hash import block_hashes, whole_hash
from k3verify.serving.prefix_pages import SharedLatentCache
from k3verify.serving.prefix_snapshots import Snapshot


@dataclass(eq=False)
class Entry:
    """A snapshot after `end` prompt tokens and the pages holding positions [0, end), from one prefill."""

    key: bytes
    end: int
    pages: list[int]
    snapshot: Snapshot
    blocks: list[bytes]  # the block hashes of its prefix
    whole: bool = False
    pins: int = 0
    last_used: int = 0


@dataclass
class Hit:
    """Where a request resumes: `position` prompt tokens come from the cache (0: a miss, then `reason` says why).

    `pages` hold the positions [0, position) in order; `snapshot` is the KDA state there (None at 0); `matched` is
    how many tokens the chain of full blocks matched; `entry` stays pinned until `release`."""

    position: int
    pages: list[int]
    snapshot: Snapshot | None
    matched: int
    reason: str
    entry: Entry | None = None

    @property
    def whole(self) -> bool:
        return self.reason == "whole"


@dataclass
class Counters:
    hits: int = 0
    misses: Counter[str] = field(default_factory=Counter)  # by reason
    tokens_reused: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self, pages: SharedLatentCache, *, block: int, grid: int, budget_bytes: int,
                 chunk: int = 64) -> None:
        if block < 1 or block % chunk:
            raise ValueError(f"block must be a positive multiple of the {chunk}-token KDA chunk; got {block}")
        if grid < block or grid % block:
            raise ValueError(f"grid must be a positive multiple of the block ({block}); got {grid}")
        if block % pages.page_size:
            raise ValueError(f"block ({block}) must be a multiple of the page size ({pages.page_size})")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0; got {budget_bytes}")
        self.kv, self.block, self.grid, self.budget_bytes = pages, block, grid, budget_bytes
        self.entries: dict[bytes, Entry] = {}
        self.blocks: Counter[bytes] = Counter()  # block hash -> entries whose prefix holds it
        self.counters = Counters()
        self._clock = itertools.count(1)
        self._bytes = 0  # kept as entries come and go: /metrics reads it from another thread

    @property
    def snapshot_bytes(self) -> int:
        return self._bytes

    @property
    def num_snapshots(self) -> int:
        return len(self.entries)

    def lookup(self, tokens: list[int], root: bytes) -> Hit:
        """The deepest place `tokens` may resume: its whole-prompt entry, else the deepest block entry within the
        matched chain that leaves at least one token to prefill. Pins what it returns."""
        if not tokens:
            raise ValueError("lookup of an empty prompt")
        hashes = block_hashes(tokens, self.block, root)
        matched = next((j for j, h in enumerate(hashes) if h not in self.blocks), len(hashes)) * self.block
        whole = self.entries.get(whole_hash(tokens, self.block, root))
        if whole is not None:
            return self._hit(whole, matched, "whole")
        for j in range(min(matched, len(tokens) - 1) // self.block, 0, -1):
            e = self.entries.get(hashes[j - 1])
            if e is not None:
                return self._hit(e, matched, "block")
        reason = "no_match" if not matched else "no_snapshot"
        self.counters.misses[reason] += 1
        return Hit(0, [], None, matched, reason)

    def _hit(self, entry: Entry, matched: int, reason: str) -> Hit:
        entry.pins += 1
        entry.last_used = next(self._clock)
        self.counters.hits += 1
        self.counters.tokens_reused += entry.end
        return Hit(entry.end, list(entry.pages), entry.snapshot, matched, reason, entry)

    def release(self, hit: Hit) -> None:
        """Unpin a hit's entry (its request copied the snapshot and holds the pages itself, or went away)."""
        if hit.entry is not None:
            if hit.entry.pins < 1:
                raise RuntimeError(f"prefix entry at {hit.entry.end} released more often than pinned")
            hit.entry.pins -= 1
            hit.entry = None

    def snapshot_positions(self, num_tokens: int, hit: Hit) -> list[int]:
        """Where a request's prefill should stop and snapshot (ascending, past hit.position): the junction, the
        sparse grid, the last full block before its end; its end (the whole-prompt entry) comes on top."""
        last = (num_tokens - 1) // self.block * self.block
        points = set(range(self.grid, last + 1, self.grid))
        if hit.position < hit.matched <= last:
            points.add(hit.matched)
        if last > 0:
            points.add(last)
        return sorted(p for p in points if p > hit.position)

    def insert(self, tokens: list[int], root: bytes, position: int, table: list[int], snapshot: Snapshot) -> bool:
        """Record that a sequence with page table `table` holds `tokens[:position]` and that `snapshot` is its
        state there (position on the block grid, or the whole prompt with its last logits). Returns whether the
        snapshot is cached (this one, or an earlier one of the same prefix)."""
        page = self.kv.page_size
        whole = position == len(tokens) and snapshot.logits is not None
        if snapshot.position != position or not (whole or (0 < position <= len(tokens) and position % self.block == 0)):
            raise ValueError(f"snapshot at {snapshot.position} inserted at {position} of a {len(tokens)}-token prompt "
                             f"(block {self.block}, whole-prompt entries need their last logits)")
        if len(table) * page < position:
            raise ValueError(f"a table of {len(table)} pages cannot hold {position} tokens")
        hashes = block_hashes(tokens[:position], self.block, root)
        key = whole_hash(tokens, self.block, root) if whole else hashes[-1]
        known = self.entries.get(key)
        if known is not None:
            known.last_used = next(self._clock)
            return True
        if snapshot.nbytes > self.budget_bytes:
            return False
        pages = table[:-(-position // page)]
        self.kv.hold(pages)
        entry = Entry(key, position, pages, snapshot, hashes, whole, last_used=next(self._clock))
        self.entries[key] = entry
        self._bytes += snapshot.nbytes
        self.blocks.update(hashes)
        while self.snapshot_bytes > self.budget_bytes:
            victims = [e for e in self.entries.values() if e.pins == 0 and e is not entry]
            if not victims:
                self._drop(entry)  # what is pinned leaves no room for it
                return False
            self._drop(min(victims, key=lambda e: e.last_used))
        return True

    def _drop(self, e: Entry) -> None:
        del self.entries[e.key]
        self._bytes -= e.snapshot.nbytes
        self.blocks.subtract(e.blocks)
        for h in e.blocks:
            if self.blocks[h] <= 0:
                del self.blocks[h]
        self.kv.unhold(e.pages)
        self.counters.evictions += 1

    def evict_pages(self, need: int) -> int:
        """Evict least recently used unpinned entries until `need` pages are free (or nothing is left to evict);
        returns the free pages then."""
        while self.kv.num_free_pages < need:
            victims = [e for e in self.entries.values() if e.pins == 0]
            if not victims:
                break
            self._drop(min(victims, key=lambda e: e.last_used))
        return self.kv.num_free_pages

    def clear(self) -> None:
        """Forget every entry; refuses while a request is resuming from one."""
        pinned = [e for e in self.entries.values() if e.pins]
        if pinned:
            raise RuntimeError(f"{len(pinned)} prefix entries are pinned by requests being admitted")
        for e in list(self.entries.values()):
            self._drop(e)

    def check_integrity(self) -> None:
        """Entries hold snapshots at their ends, the block counts and held pages match the entries."""
        problems = []
        blocks: Counter[bytes] = Counter(h for e in self.entries.values() for h in e.blocks)
        held: Counter[int] = Counter(p for e in self.entries.values() for p in e.pages)
        for e in self.entries.values():
            if e.snapshot.position != e.end:
                problems.append(f"entry at {e.end} holds a snapshot at {e.snapshot.position}")
            if len(e.pages) * self.kv.page_size < e.end:
                problems.append(f"entry at {e.end} holds {len(e.pages)} pages")
        if blocks != self.blocks:
            problems.append("the counted blocks differ from the entries' prefixes")
        if self._bytes != sum(e.snapshot.nbytes for e in self.entries.values()):
            problems.append(f"the snapshot bytes counted ({self._bytes}) differ from the entries'")
        if held != self.kv.held:
            problems.append("the pages the entries hold differ from the pages the latent cache counts as held")
        if problems:
            raise RuntimeError("prefix cache integrity: " + "; ".join(problems[:6]))
