"""The prefix cache's index: which prompt prefixes are cached, where a request may resume, and what to evict.

Prompts are cut into blocks of `block` tokens (the KDA chunk grid or a multiple of it: a prefill resumed there
rounds exactly as one run whole, serving/layers/kda.py check_pieces). Each block is an entry keyed by its chained
hash (serving/prefix_hash.py) holding the MLA pages of its positions; an entry may also hold a snapshot of the
KDA state at its end (serving/prefix_snapshots.py). A prompt's exact end is a whole-prompt entry (its tail pages,
the state after the whole prompt and the logits of its last position): a repeated prompt, however short, resumes
with nothing to prefill.

Snapshots are kept at the junction (the end of the last full block a request shares with what is cached, where
the next request with that prefix will branch again), on a sparse grid of `grid` tokens, at the last full block
of every prompt, and at every prompt's end. Their bytes stay under `budget_bytes`: the least recently used
snapshot goes first, never one a request is resuming from (pinned until its admission copied it). Entries whose
pages nothing deeper needs go with their last snapshot; page pressure evicts least recently used leaves.
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
    """A cached block (or a whole prompt) at prompt positions [start, end)."""

    key: bytes
    parent: Entry | None
    start: int
    end: int
    pages: list[int]  # the pages this entry holds (its positions not on a parent's pages)
    whole: bool = False
    snapshot: Snapshot | None = None
    children: int = 0
    pins: int = 0
    last_used: int = 0

    def path(self) -> list[Entry]:
        """This entry and its ancestors, root first."""
        out: list[Entry] = []
        e: Entry | None = self
        while e is not None:
            out.append(e)
            e = e.parent
        return out[::-1]


@dataclass
class Hit:
    """Where a request resumes: `position` prompt tokens come from the cache (0: a miss, then `reason` says why).

    `pages` hold the positions [0, position) in order; `snapshot` is the KDA state there (None at 0); `matched` is
    how many tokens the chain of full blocks matched; `entries` stay pinned until `release`."""

    position: int
    pages: list[int]
    snapshot: Snapshot | None
    matched: int
    reason: str
    entries: list[Entry] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return self.reason == "whole"


@dataclass
class Counters:
    hits: int = 0
    misses: Counter[str] = field(default_factory=Counter)  # by reason
    tokens_reused: int = 0
    evicted_snapshots: int = 0
    evicted_entries: int = 0


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
        self.counters = Counters()
        self._clock = itertools.count(1)

    @property
    def snapshot_bytes(self) -> int:
        return sum(e.snapshot.nbytes for e in self.entries.values() if e.snapshot is not None)

    @property
    def num_snapshots(self) -> int:
        return sum(1 for e in self.entries.values() if e.snapshot is not None)

    def lookup(self, tokens: list[int], root: bytes) -> Hit:
        """The deepest place `tokens` may resume: its whole-prompt entry, else the deepest block snapshot at or
        before the matched chain's end that leaves at least one token to prefill. Pins what it returns."""
        if not tokens:
            raise ValueError("lookup of an empty prompt")
        whole = self.entries.get(whole_hash(tokens, self.block, root))
        chain: list[Entry] = []
        for h in block_hashes(tokens, self.block, root):
            e = self.entries.get(h)
            if e is None:
                break
            chain.append(e)
        matched = chain[-1].end if chain else 0
        if whole is not None and whole.snapshot is not None:
            return self._hit(whole, matched, "whole")
        usable = [e for e in chain if e.snapshot is not None and e.end < len(tokens)]
        if usable:
            return self._hit(usable[-1], matched, "block")
        reason = "no_match" if not chain else "no_snapshot"
        self.counters.misses[reason] += 1
        return Hit(0, [], None, matched, reason)

    def _hit(self, entry: Entry, matched: int, reason: str) -> Hit:
        path, now = entry.path(), next(self._clock)
        for e in path:
            e.pins += 1
            e.last_used = now
        assert entry.snapshot is not None
        self.counters.hits += 1
        self.counters.tokens_reused += entry.snapshot.position
        return Hit(entry.snapshot.position, [p for e in path for p in e.pages], entry.snapshot, matched, reason, path)

    def release(self, hit: Hit) -> None:
        """Unpin a hit's entries (its request copied the snapshot and holds the pages itself, or went away)."""
        for e in hit.entries:
            if e.pins < 1:
                raise RuntimeError(f"prefix entry at [{e.start}, {e.end}) released more often than pinned")
            e.pins -= 1
        hit.entries = []

    def snapshot_positions(self, num_tokens: int, hit: Hit) -> list[int]:
        """Where a request's prefill should stop and snapshot (ascending, past hit.position): the junction, the
        sparse grid, the last full block before its end; its end (the whole-prompt entry) comes on top."""
        last = (num_tokens - 1) // self.block * self.block
        points = {p for p in range(self.grid, last + 1, self.grid)}
        if hit.matched > hit.position and hit.matched <= last:
            points.add(hit.matched)
        if last > 0:
            points.add(last)
        return sorted(p for p in points if p > hit.position)

    def insert(self, tokens: list[int], root: bytes, position: int, table: list[int], snapshot: Snapshot) -> bool:
        """Record that a sequence with page table `table` holds `tokens[:position]` and that `snapshot` is its
        state there (position on the block grid, or the whole prompt with its last logits). Returns whether the
        snapshot was kept (within the budget)."""
        page = self.kv.page_size
        whole = position == len(tokens) and snapshot.logits is not None
        if snapshot.position != position or not (whole or (0 < position <= len(tokens) and position % self.block == 0)):
            raise ValueError(f"snapshot at {snapshot.position} inserted at {position} of a {len(tokens)}-token prompt "
                             f"(block {self.block}, whole-prompt entries need their last logits)")
        if len(table) * page < position:
            raise ValueError(f"a table of {len(table)} pages cannot hold {position} tokens")
        if snapshot.nbytes > self.budget_bytes:
            return False
        hashes = block_hashes(tokens, self.block, root)
        parent: Entry | None = None
        full = position // self.block
        for j, h in enumerate(hashes[:full]):
            e = self.entries.get(h)
            if e is None:
                pages = table[j * self.block // page:(j + 1) * self.block // page]
                self.kv.hold(pages)
                e = Entry(h, parent, j * self.block, (j + 1) * self.block, pages)
                self.entries[h] = e
                if parent is not None:
                    parent.children += 1
            parent = e
        if whole:
            key = whole_hash(tokens, self.block, root)
            target = self.entries.get(key)
            if target is None:
                start = full * self.block
                pages = table[start // page:-(-position // page)]
                self.kv.hold(pages)
                target = Entry(key, parent, start, position, pages, whole=True)
                self.entries[key] = target
                if parent is not None:
                    parent.children += 1
        else:
            assert parent is not None
            target = parent
        target.last_used = next(self._clock)
        if target.snapshot is not None:
            return True  # the same prefix's state, cached by an earlier request
        target.snapshot = snapshot
        self._fit(keep=target)
        if self.snapshot_bytes > self.budget_bytes:  # what is pinned leaves no room for it
            self._drop_snapshot(target)
            return False
        return True

    def _fit(self, keep: Entry | None = None) -> None:
        """Evict least recently used snapshots (never pinned ones, nor `keep`'s) until within the budget."""
        while self.snapshot_bytes > self.budget_bytes:
            victims = [e for e in self.entries.values() if e.snapshot is not None and e.pins == 0 and e is not keep]
            if not victims:
                return
            self._drop_snapshot(min(victims, key=lambda e: e.last_used))

    def _drop_snapshot(self, e: Entry) -> None:
        e.snapshot = None
        self.counters.evicted_snapshots += 1
        self._prune(e)

    def _prune(self, e: Entry | None) -> None:
        """Remove entries that hold no snapshot, have no children and are not pinned, walking up."""
        while e is not None and e.snapshot is None and e.children == 0 and e.pins == 0:
            del self.entries[e.key]
            self.kv.unhold(e.pages)
            self.counters.evicted_entries += 1
            parent = e.parent
            if parent is not None:
                parent.children -= 1
            e = parent

    def evict_pages(self, need: int) -> int:
        """Evict least recently used unpinned leaves until `need` pages are free (or nothing is left to evict);
        returns the free pages then."""
        while self.kv.num_free_pages < need:
            leaves = [e for e in self.entries.values() if e.children == 0 and e.pins == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda e: e.last_used)
            if victim.snapshot is not None:
                self._drop_snapshot(victim)
            else:
                self._prune(victim)
        return self.kv.num_free_pages

    def clear(self) -> None:
        """Forget every entry (the weights changed); refuses while a request is resuming from one."""
        pinned = [e for e in self.entries.values() if e.pins]
        if pinned:
            raise RuntimeError(f"{len(pinned)} prefix entries are pinned by requests being admitted")
        for e in self.entries.values():
            self.kv.unhold(e.pages)
        self.counters.evicted_entries += len(self.entries)
        self.entries.clear()

    def check_integrity(self) -> None:
        """Every entry's parent is cached, children counts match, held pages match the entries' pages."""
        problems = []
        children: Counter[bytes] = Counter(e.parent.key for e in self.entries.values() if e.parent is not None)
        held: Counter[int] = Counter(p for e in self.entries.values() for p in e.pages)
        for e in self.entries.values():
            if e.parent is not None and self.entries.get(e.parent.key) is not e.parent:
                problems.append(f"entry [{e.start}, {e.end}) has an evicted parent")
            if e.children != children[e.key]:
                problems.append(f"entry [{e.start}, {e.end}) counts {e.children} children, has {children[e.key]}")
            if e.snapshot is not None and e.snapshot.position != e.end:
                problems.append(f"entry [{e.start}, {e.end}) holds a snapshot at {e.snapshot.position}")
        if held != self.kv.held:
            problems.append("the pages the entries hold differ from the pages the latent cache counts as held")
        if problems:
            raise RuntimeError("prefix cache integrity: " + "; ".join(problems[:6]))
