"""The prefix cache's parts on their own: chained block hashes, refcounted MLA pages with copy-on-write, KDA state
snapshots, and the index (whole-prompt entries, resume at the deepest snapshot, junctions, the snapshot budget,
page eviction, pins)."""

from __future__ import annotations

import pytest
import torch

from k3verify.presets import get_preset
from k3verify.serving.kv_cache import CacheError
from k3verify.serving.prefix_cache import PrefixCache
from k3verify.serving.prefix_hash import block_hashes, root_hash, whole_hash
from k3verify.serving.prefix_pages import SharedLatentCache
from k3verify.serving.prefix_snapshots import restore, snapshot_bytes, take
from k3verify.serving.state_cache import KDAStatePool

CFG = get_preset("k3-tiny")
ROOT = root_hash("weights-a", 0)
B, PAGE = 64, 16


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_block_hashes_chain_the_parent_and_name_weights_and_key() -> None:
    """An equal block under a different first block hashes differently; so do other weights, a reload and another
    key; a whole prompt of one block is not that block as a prefix."""
    a, b, tail = ids(B, 1), ids(B, 2), ids(B, 3)
    assert block_hashes(a + tail, B, ROOT)[1] != block_hashes(b + tail, B, ROOT)[1]
    assert block_hashes(a + tail, B, ROOT)[0] == block_hashes(a + b, B, ROOT)[0]
    roots = {ROOT, root_hash("weights-b", 0), root_hash("weights-a", 1), root_hash("weights-a", 0, "key-1"),
             root_hash("weights-a", 0, "key-2")}
    assert len(roots) == 5
    assert whole_hash(a, B, ROOT) != block_hashes(a, B, ROOT)[0]
    assert whole_hash(a[:3], B, ROOT) != whole_hash(a[:3] + [0], B, ROOT) and not block_hashes(a[:3], B, ROOT)


def test_shared_pages_return_to_the_free_list_with_their_last_holder_and_copy_on_write() -> None:
    kv = SharedLatentCache(CFG, num_pages=12, page_size=PAGE, dtype=torch.float32, device="cpu")
    kv.reserve(1, 40)
    shared = kv.table(1)
    kv.data[:, shared[2]] = 7.0
    kv.hold(shared)
    kv.free(1)
    assert kv.num_free_pages == 11 - 3  # the cache still holds the three pages
    kv.reserve(2, 70, shared=shared)
    assert kv.table(2)[:3] == shared and kv.refs[shared[0]] == 2
    own = kv.copy_on_write(2, 2)
    assert own != shared[2] and kv.table(2)[2] == own and torch.equal(kv.data[:, own], kv.data[:, shared[2]])
    assert kv.refs[shared[2]] == 1 and kv.num_copied == 1
    assert kv.copy_on_write(2, 3) == kv.table(2)[3]  # not shared: no copy
    kv.check_integrity()
    kv.unhold(shared)
    kv.free(2)
    assert kv.num_free_pages == 11
    kv.check_integrity()
    with pytest.raises(CacheError, match="held by no one"):
        kv.reserve(3, 20, shared=shared[:1])


def test_page_integrity_catches_a_reference_count_that_is_off() -> None:
    """The control: one extra count (a page that would never be freed) is an integrity failure naming it."""
    kv = SharedLatentCache(CFG, num_pages=6, page_size=PAGE, dtype=torch.float32, device="cpu")
    kv.reserve(1, 20)
    kv.check_integrity()
    kv.refs[kv.table(1)[0]] += 1
    with pytest.raises(CacheError, match=f"page reference counts disagree .* page\\(s\\) \\[{kv.table(1)[0]}\\]"):
        kv.check_integrity()


def test_snapshot_restores_exactly_and_no_later_write_reaches_it() -> None:
    pool = KDAStatePool(CFG, num_slots=3, device="cpu")
    a, b = pool.allocate(), pool.allocate()
    for t in pool.tensors().values():
        t[:, a].normal_(generator=torch.Generator().manual_seed(5))
    before = {name: t[:, a].clone() for name, t in pool.tensors().items()}
    snap = take(pool, a, 64, logits=torch.arange(5.0))
    for t in pool.tensors().values():
        t[:, a].fill_(3.0)  # the sequence goes on: the snapshot must not move
    restore(snap, pool, b)
    for name, t in pool.tensors().items():
        assert torch.equal(t[:, b], before[name]) and not torch.equal(t[:, a], t[:, b]), name
    assert snap.nbytes == snapshot_bytes(pool, 5)
    with pytest.raises(ValueError, match="not in use"):
        restore(snap, pool, 3)


class Fixture:
    """A SharedLatentCache, a state pool and a PrefixCache over them; `serve` plays a request: lookup, admit with
    the shared pages, snapshot at the planned positions and the end, insert, release."""

    def __init__(self, budget_snapshots: float = 100, grid: int = 2 * B, num_pages: int = 64) -> None:
        self.kv = SharedLatentCache(CFG, num_pages=num_pages, page_size=PAGE, dtype=torch.float32, device="cpu")
        self.pool = KDAStatePool(CFG, num_slots=4, device="cpu")
        self.one = snapshot_bytes(self.pool, 8)
        self.cache = PrefixCache(self.kv, block=B, grid=grid, budget_bytes=int(budget_snapshots * self.one))
        self.ids = iter(range(1, 10_000))

    def serve(self, tokens: list[int], root: bytes = ROOT) -> tuple[int, str, list[int]]:
        seq = next(self.ids)
        hit = self.cache.lookup(tokens, root)
        self.kv.reserve(seq, len(tokens) + 4, shared=hit.pages)
        slot = self.pool.allocate()
        if hit.snapshot is not None:
            restore(hit.snapshot, self.pool, slot)
        self.cache.release(hit)
        points = self.cache.snapshot_positions(len(tokens), hit)
        for p in points:
            self.cache.insert(tokens, root, p, self.kv.table(seq), take(self.pool, slot, p))
        logits = torch.zeros(8)
        self.cache.insert(tokens, root, len(tokens), self.kv.table(seq), take(self.pool, slot, len(tokens), logits))
        self.kv.free(seq)
        self.pool.free(slot)
        self.cache.check_integrity()
        self.kv.check_integrity()
        return hit.position, hit.reason, points


def test_a_short_prompt_sent_again_is_a_whole_prompt_hit_and_its_extension_is_not() -> None:
    f = Fixture()
    short = ids(3, 7)
    assert f.serve(short)[:2] == (0, "no_match")
    position, reason, _ = f.serve(short)
    assert (position, reason) == (3, "whole")
    assert f.serve(short + [1])[:2] == (0, "no_match")


def test_a_hit_resumes_at_the_deepest_snapshot_before_the_match_end_and_plans_the_junction() -> None:
    """First prompt: 5 blocks + 10 (snapshots on the grid of 2 blocks, at its last block and its end). A prompt
    sharing 3 blocks and 20 tokens of the 4th resumes at the grid snapshot 128 and snapshots the junction 192; the
    next one with that prefix resumes at 192. One token off inside the 4th block matches only 3 blocks. A hit always
    leaves a token to prefill, except a whole-prompt hit."""
    f = Fixture()
    base = ids(5 * B + 10, 11)
    assert f.serve(base) == (0, "no_match", [128, 256, 320])
    branch = base[:3 * B + 20] + ids(50, 12)
    assert f.serve(branch) == (128, "block", [192, 256])
    assert f.serve(base[:3 * B + 20] + ids(40, 13))[:2] == (192, "block")
    off = list(base)
    off[3 * B + 5] += 1
    assert f.serve(off)[:2] == (192, "block")
    # exactly the first 2 blocks: the snapshot at 128 would leave nothing to prefill and none is at 64 yet
    assert f.serve(base[:2 * B]) == (0, "no_snapshot", [64])
    assert f.serve(base[:2 * B] + [5])[:2] == (128, "block")
    assert f.serve(base)[:2] == (len(base), "whole")


def test_the_same_tokens_under_another_key_or_weights_miss() -> None:
    f = Fixture()
    prompt = ids(2 * B + 3, 21)
    f.serve(prompt)
    assert f.serve(prompt, root_hash("weights-a", 0, "key-1"))[:2] == (0, "no_match")
    assert f.serve(prompt, root_hash("weights-a", 1))[:2] == (0, "no_match")
    assert f.serve(prompt)[:2] == (len(prompt), "whole")


def test_snapshot_budget_evicts_least_recently_used_never_a_pinned_one() -> None:
    f = Fixture(budget_snapshots=3, grid=8 * B)
    prompts = [ids(B + 5, 30 + i) for i in range(3)]  # each leaves 2 snapshots: its block and its end
    f.serve(prompts[0])
    pinned = f.cache.lookup(prompts[0], ROOT)
    assert pinned.reason == "whole"
    f.serve(prompts[1])
    f.serve(prompts[2])
    assert f.cache.snapshot_bytes <= 3 * f.one and f.cache.counters.evictions >= 3
    assert pinned.entry is not None and pinned.entry.key in f.cache.entries
    f.cache.release(pinned)
    f.cache.check_integrity()
    assert f.serve(prompts[2])[1] == "whole"  # the newest survived


def test_page_pressure_evicts_unpinned_leaves_and_frees_their_pages() -> None:
    f = Fixture(num_pages=40)
    for i in range(3):
        f.serve(ids(3 * B, 40 + i))
    held = len(f.kv.held)
    assert held == 3 * 12 and f.kv.num_free_pages == 39 - held
    assert f.cache.evict_pages(30) >= 30
    f.cache.check_integrity()
    f.kv.check_integrity()
    f.cache.clear()
    assert f.kv.num_free_pages == 39 and not f.kv.held
