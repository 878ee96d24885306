"""The step loop's CUDA-only staging branch (pinned rings guarded by events) run on CPU with a stand-in event.

On a CPU device HostStaging and PinnedReadback copy synchronously and never touch their rings; on CUDA every
per-step transfer goes through a ring of pinned buffers, each reused only after the event of its last copy
completed, and the engine reads step n's ids after launching step n+1. Here the rings run on CPU (pin_memory
dropped) with an event that reports "not done" until someone waits for it (the slowest GPU), so the branch's
bookkeeping is exercised: a buffer handed out again while a launched step still needs it, or a step read
before its event was waited for, shows as a token/logprob mismatch or a failed assertion."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving import staging
from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.graphs import GraphDecoder, engine_buckets
from k3verify.serving.runner import ModelRunner, build_runner
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.step_loop import LaunchedStep, RowResult, StepLauncher
from k3verify.tokenizer import default_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [100, 200, 300, 400, 500, 600, 700], [1, 2, 3, 4, 5, 6, 7] * 5]
NEW = 6


class SlowEvent:
    """torch.cuda.Event as the slowest GPU would answer: a copy is done only once someone waited for it."""

    made: list[SlowEvent] = []

    def __init__(self) -> None:
        self.recorded = self.waited = False
        SlowEvent.made.append(self)

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        assert self.recorded, "waited for an event that was never recorded"
        self.waited = True


def _runner() -> ModelRunner:
    """A fresh runner per run: a bucket's padded rows run on the scratch slot, whose state carries over from one
    run to the next and moves live rows' fp32 logprobs by an ulp (measured: zeroing the scratch slot between two
    runs on one runner makes them equal), so runs compare exactly only from the same start."""
    cfg = get_preset("k3-tiny")
    return build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, page_size=8, num_slots=4,
                        max_context=64)


def _pin(*holders: Any, depth: int = 8) -> None:
    """Switch HostStaging / PinnedReadback objects to their pinned-ring branch (small rings: growth runs too)."""
    for h in holders:
        h._ring = staging._Ring(True, depth, 16)


def _run(runner: ModelRunner, params: SamplingParams, *, pinned: bool, readback_depth: int = 8
         ) -> list[list[tuple[int, float]]]:
    """(token, chosen logprob) of every prompt through the real engine (overlapped steps, static graph step);
    a request that failed contributes its error instead."""
    cfg = runner.model.cfg
    graphs = GraphDecoder(runner.model, runner.max_context, buckets=engine_buckets(4), use_graphs=False)
    engine = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                    max_step_tokens=16, graphs=graphs)
    if pinned:
        _pin(runner.staging, graphs.staging, engine.launcher.staging)
        _pin(engine.launcher.readback, depth=readback_depth)
    out: list[list[Any]] = [[] for _ in PROMPTS]
    done = [threading.Event() for _ in PROMPTS]

    def sink(i: int) -> Callable[[EngineEvent], None]:
        def put(ev: EngineEvent) -> None:
            out[i] += [(lp.token_id, lp.logprob) for lp in ev.logprobs] + ([ev.error] if ev.error else [])
            if ev.finished:
                done[i].set()
        return put

    engine.start()
    release = threading.Event()
    holder = threading.Thread(target=engine.call, args=(release.wait,))  # every prompt admitted by one step:
    holder.start()  # the same packing in every run, so fp32 logprobs compare exactly
    try:
        for i, p in enumerate(PROMPTS):
            engine.submit(p, params, sink(i))
        release.set()
        holder.join()
        assert all(d.wait(60) for d in done), f"a request never finished (health: {engine.health()})"
    finally:
        engine.stop()
    return out


@pytest.fixture
def cuda_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.Event -> SlowEvent; pin_memory=True dropped (no CUDA here), the rest of the branch as is."""
    empty = torch.empty

    def unpinned_empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return empty(*args, **kwargs)

    SlowEvent.made.clear()
    monkeypatch.setattr(torch.cuda, "Event", SlowEvent)
    monkeypatch.setattr(torch, "empty", unpinned_empty)


def test_pinned_rings_carry_the_same_tokens_and_logprobs(cuda_branch: None, monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Greedy with logprobs (three readbacks a step) and seeded sampling: the pinned branch returns what the
    synchronous CPU copies return, every launched step is read only after its event was waited for."""
    waited_before_read: list[bool] = []
    collect = StepLauncher.collect

    def checked_collect(step: LaunchedStep) -> list[RowResult]:
        assert isinstance(step.event, SlowEvent), f"the pinned branch returned {step.event!r}"
        rows = collect(step)
        waited_before_read.append(step.event.waited)
        return rows

    for params in (SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=3),
                   SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True, logprobs=1)):
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "Event", lambda: pytest.fail("the CPU branch made a CUDA event"))
            want = _run(_runner(), params, pinned=False)
        monkeypatch.setattr(StepLauncher, "collect", staticmethod(checked_collect))
        got = _run(_runner(), params, pinned=True)
        monkeypatch.setattr(StepLauncher, "collect", staticmethod(collect))
        assert got == want
        assert [len(o) for o in got] == [NEW] * len(PROMPTS)
        assert waited_before_read and all(waited_before_read)
        assert SlowEvent.made and all(e.recorded for e in SlowEvent.made)


def test_a_ring_too_shallow_for_the_overlap_is_caught(cuda_branch: None) -> None:
    """Control: with a readback ring of depth 3, step n+1's three copies (ids, top ids, top values) take step
    n's buffers before step n is read, and what the engine delivers differs from the synchronous run."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=3)
    want = _run(_runner(), params, pinned=False)
    assert _run(_runner(), params, pinned=True) == want
    assert _run(_runner(), params, pinned=True, readback_depth=3) != want
