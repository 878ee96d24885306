"""The engine with the prefix cache on: a request served from a cached prefix gives the same bits (tokens and
logprobs) as the same request served cold in the same prefill segments (the cache's snapshot cuts and its cached
prefix's cuts, serving/runner.py cuts_of), in fp32 and bf16, over many prompts with branches at random block
offsets, under snapshot and page eviction, with speculative decoding; under concurrency the tokens are the cold
ones. On this CPU a GEMM's rows depend on the row count only for a few small counts (1, 2, 11 of 300 rows differ
from the same rows of the whole): the segments, not the cache, decide the bits."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.kv_cache import CacheError
from k3verify.serving.prefix_reuse import PrefixSettings
from k3verify.serving.runner import ModelRunner, build_runner
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.scheduler import ScheduledSeq, Scheduler
from k3verify.serving.spec.step import build_speculative_step
from k3verify.tokenizer import default_tokenizer

CFG = get_preset("k3-tiny")
NEW = 5


@dataclass
class Served:
    tokens: list[int]
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]]
    cuts: tuple[int, ...]
    cached: int


def make_runner(dtype: torch.dtype, *, prefix: PrefixSettings | None, num_pages: int = 160) -> ModelRunner:
    runner = build_runner(CFG, synthetic_tensors(CFG), dtype=dtype, num_pages=num_pages, page_size=16, num_slots=4,
                          max_context=640)
    if prefix is not None:
        runner.enable_prefix_cache("k3-tiny-synthetic", CFG.vocab_size, prefix)
    return runner


@contextmanager
def forced_cuts(points: list[tuple[int, ...]]) -> Iterator[None]:
    """Scheduler.add gives each added sequence the next forced cut positions (as snapshot points)."""
    add = Scheduler.add

    def add_with_cuts(self: Scheduler, seq: ScheduledSeq) -> None:
        seq.snapshot_points = tuple(c for c in points.pop(0) if 0 < c < len(seq.prompt_ids))
        add(self, seq)

    Scheduler.add = add_with_cuts  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler.add = add  # type: ignore[method-assign]


def serve(runner: ModelRunner, prompts: list[list[int]], *, together: bool = False, max_step_tokens: int = 1024,
          speculate: bool = False, keys: list[str | None] | None = None) -> list[Served]:
    """Each prompt's greedy answer with top-3 logprobs, the cuts of its prefill and its cached prompt tokens."""
    step = build_speculative_step(runner, "ngram", 3, 4) if speculate else None
    engine = Engine(runner, default_tokenizer(), eos_token_ids=CFG.eos_token_ids, vocab_size=CFG.vocab_size,
                    max_step_tokens=max_step_tokens, speculator=step).start()
    events: list[list[EngineEvent]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    seqs: dict[int, int] = {}
    cuts: dict[int, tuple[int, ...]] = {}
    cached: dict[int, int] = {}
    release = runner.release

    def record(seq_id: int) -> None:
        cuts[seq_id] = runner.cuts_of(seq_id)
        release(seq_id)

    setattr(runner, "release", record)  # noqa: B010 (an instance attribute shadows the method)
    admit = Scheduler._admit

    def admit_recording(self: Scheduler, seq: ScheduledSeq) -> None:
        admit(self, seq)
        cached[seq.seq_id] = seq.num_cached

    def sink(i: int) -> Callable[[EngineEvent], None]:
        def put(ev: EngineEvent) -> None:
            events[i].append(ev)
            if ev.finished:
                done[i].set()
        return put

    Scheduler._admit = admit_recording  # type: ignore[method-assign]
    try:
        for i, p in enumerate(prompts):
            key = keys[i] if keys is not None else None
            params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=3, cache_key=key)
            seqs[i] = engine.submit(p, params, sink(i))
            if not together:
                assert done[i].wait(120), f"request {i} never finished"
        assert all(d.wait(120) for d in done), "a request never finished"
        engine.check_integrity()
        assert engine.health_tracker.restarts == 0, engine.health_tracker.last_restart_reason
    finally:
        Scheduler._admit = admit  # type: ignore[method-assign]
        engine.stop()
    out = []
    for i, evs in enumerate(events):
        assert evs[-1].error is None, evs[-1].error
        logprobs = [(lp.logprob, lp.top) for e in evs for lp in e.logprobs]
        out.append(Served([t for e in evs for t in e.token_ids], logprobs, cuts[seqs[i]], cached.get(seqs[i], 0)))
    return out


def cold(dtype: torch.dtype, prompts: list[list[int]], served: list[Served], **kw: Any) -> list[Served]:
    """Each prompt alone on a runner without the cache, its prefill cut where the served request's was."""
    with forced_cuts([s.cuts for s in served]):
        return serve(make_runner(dtype, prefix=None), prompts, **kw)


def family(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing prefixes of random lengths (some on a block edge, some one off it), repeats, short ones."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 4000, (420,), generator=g).tolist()
    out: list[list[int]] = []
    for _ in range(n):
        kind = int(torch.randint(0, 4, (1,), generator=g))
        if kind == 0 and out:  # a repeat
            out.append(list(out[int(torch.randint(0, len(out), (1,), generator=g))]))
            continue
        edge = 64 * int(torch.randint(1, 6, (1,), generator=g)) + int(torch.randint(-1, 2, (1,), generator=g))
        shared = edge if kind == 1 else int(torch.randint(1, 400, (1,), generator=g))
        tail = torch.randint(0, 4000, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        out.append(base[:shared] + tail if kind != 3 else base[: 1 + shared % 5])
    return out


def assert_same_bits(hot: list[Served], ref: list[Served]) -> None:
    for i, (h, r) in enumerate(zip(hot, ref, strict=True)):
        assert h.tokens == r.tokens and h.logprobs == r.logprobs, (i, h.cached, h.cuts, h.tokens, r.tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hits_give_the_cold_bits_in_the_same_segments(dtype: torch.dtype) -> None:
    """16 prompts of one family, one at a time: most are hits (whole prompts too), each equals cold."""
    prompts = family(1, 16)
    runner = make_runner(dtype, prefix=PrefixSettings(grid=128))
    hot = serve(runner, prompts)
    counters = runner.prefix.cache.counters if runner.prefix is not None else None
    assert counters is not None and counters.hits >= 8 and counters.tokens_reused > 800, counters
    assert any(h.cached == len(p) for h, p in zip(hot, prompts, strict=True)), "no whole-prompt hit"
    assert any(0 < h.cached < len(p) for h, p in zip(hot, prompts, strict=True)), "no block hit"
    assert_same_bits(hot, cold(dtype, prompts, hot))


def test_hits_under_snapshot_and_page_eviction_give_the_cold_bits() -> None:
    """A budget of 3 snapshots and a page pool the cache must give back to admit: still the cold bits."""
    prompts = family(2, 12)
    runner = make_runner(torch.float32, prefix=PrefixSettings(grid=128), num_pages=48)
    assert runner.prefix is not None
    runner.prefix.cache.budget_bytes = 3 * runner.prefix.one_snapshot
    hot = serve(runner, prompts)
    c = runner.prefix.cache.counters
    assert c.hits >= 4 and c.evictions >= 4, c
    assert runner.prefix.cache.snapshot_bytes <= 3 * runner.prefix.one_snapshot
    assert_same_bits(hot, cold(torch.float32, prompts, hot))


def test_hits_with_speculative_decoding_give_the_cold_bits() -> None:
    prompts = family(3, 6)
    runner = make_runner(torch.float32, prefix=PrefixSettings(grid=128))
    hot = serve(runner, prompts, speculate=True)
    assert runner.prefix is not None and runner.prefix.cache.counters.hits >= 3
    assert_same_bits(hot, cold(torch.float32, prompts, hot, speculate=True))


def test_concurrent_hits_answer_the_cold_tokens() -> None:
    """Ten requests at once (a step budget of 80 tokens) after their prefixes were cached: each answers the
    tokens it answers alone and cold (batched GEMMs of other row counts round differently on this CPU)."""
    prompts = family(4, 10)
    runner = make_runner(torch.float32, prefix=PrefixSettings(grid=128))
    serve(runner, prompts[:4])
    hot = serve(runner, prompts, together=True, max_step_tokens=80)
    ref = cold(torch.float32, prompts, hot)
    assert [h.tokens for h in hot] == [r.tokens for r in ref]
    assert runner.prefix is not None and runner.prefix.cache.counters.hits >= 5


def test_a_weight_written_in_place_is_never_served_from_the_cache() -> None:
    """The cached root names every parameter's version: after a reload (copy_) the same prompt misses."""
    prompt = family(5, 1)[0] + [7] * 70
    runner = make_runner(torch.float32, prefix=PrefixSettings(grid=128))
    serve(runner, [prompt])
    assert serve(runner, [prompt])[0].cached == len(prompt)
    with torch.no_grad():
        p = next(runner.model.parameters())
        p.copy_(p)
    assert serve(runner, [prompt])[0].cached == 0


@pytest.mark.parametrize("per_key", [False, True], ids=["shared", "per_key"])
def test_entries_are_isolated_per_key_only_when_asked(per_key: bool) -> None:
    prompt = family(6, 1)[0] + [9] * 3
    runner = make_runner(torch.float32, prefix=PrefixSettings(grid=128, per_key=per_key))
    got = [s.cached for s in serve(runner, [prompt] * 3, keys=["key-a", "key-b", "key-a"])]
    assert got == ([0, 0, len(prompt)] if per_key else [0, len(prompt), len(prompt)])


def test_integrity_refuses_a_shared_page_a_sequence_will_write() -> None:
    """Sharing pages that lie wholly before the resume position is fine; sharing the page a sequence writes next
    (what skipping copy-on-write leaves) is an integrity failure naming the sequence and the page."""
    runner = make_runner(torch.float32, prefix=PrefixSettings(grid=128))
    runner.admit(1, 80)
    runner.prefill([(1, list(range(1, 65)))])  # its first 4 pages written: it writes from page #4 on
    table = runner.kv_cache.table(1)
    runner.admit(2, 64, shared=table[:2], cached=32)
    runner.check_integrity()
    runner.release(2)
    runner.admit(3, 64, shared=table[:2], cached=20)
    with pytest.raises(CacheError, match=f"sequence 3 will write page\\(s\\) \\[{table[1]}\\] that another sequence"):
        runner.check_integrity()
