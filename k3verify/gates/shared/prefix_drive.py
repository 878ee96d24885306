"""Driving the engine for the prefix-cache checks: serve prompts one at a time or together, and record what each
request answered (tokens, logprobs), where its prefill was cut, and how many prompt tokens came from the cache; and
serve them cold in the same cuts (the reference a hit must equal).

A request's cuts (serving/runner.py cuts_of) include its cached prefix's: a cold prefill cut at the same positions
computes the same bits, while other cuts change the rows of a GEMM on some row counts (the CPU's too)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.scheduler import ScheduledSeq, Scheduler

WAIT_S = 120.0


@dataclass
class Served:
    tokens: list[int]
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]]
    cuts: tuple[int, ...]
    cached: int


Recorded = tuple[dict[int, Any], dict[int, int]]


@contextmanager
def _hooks(runner: ModelRunner, forced: list[tuple[int, ...]] | None) -> Iterator[Recorded]:
    """Record each finished sequence's cuts and each admitted one's cached tokens; with `forced`, give the n-th
    added sequence the n-th cut positions (as snapshot points, so its prefill stops there)."""
    cuts: dict[int, Any] = {}
    cached: dict[int, int] = {}
    release, admit, add = runner.release, Scheduler._admit, Scheduler.add

    def record(seq_id: int) -> None:
        cuts[seq_id] = runner.cuts_of(seq_id)
        release(seq_id)

    def admit_recording(self: Scheduler, seq: ScheduledSeq) -> None:
        admit(self, seq)
        cached[seq.seq_id] = seq.num_cached

    def add_forced(self: Scheduler, seq: ScheduledSeq) -> None:
        if forced is not None:
            seq.snapshot_points = tuple(c for c in forced.pop(0) if 0 < c < len(seq.prompt_ids))
        add(self, seq)

    setattr(runner, "release", record)  # noqa: B010 (an instance attribute shadows the method)
    _swap(admit_recording, add_forced)
    try:
        yield cuts, cached
    finally:
        _swap(admit, add)
        delattr(runner, "release")


def _swap(admit: Callable[[Scheduler, ScheduledSeq], None], add: Callable[[Scheduler, ScheduledSeq], None]) -> None:
    """The scheduler's admission and queueing, replaced for the checks' recording (restored after)."""
    setattr(Scheduler, "_admit", admit)  # noqa: B010 (the class's methods, swapped while the driver runs)
    setattr(Scheduler, "add", add)  # noqa: B010


def serve(runner: ModelRunner, tokenizer: Any, prompts: list[list[int]], params: list[SamplingParams], *,
          eos: tuple[int, ...], vocab_size: int, together: bool = False, max_step_tokens: int = 1024,
          forced: list[tuple[int, ...]] | None = None) -> list[Served]:
    """Each prompt served (one at a time unless `together`) with its SamplingParams; integrity checked after."""
    engine = Engine(runner, tokenizer, eos_token_ids=eos, vocab_size=vocab_size, max_step_tokens=max_step_tokens,
                    debug=True)  # the runner's integrity after every step: a shared page written fails there
    events: list[list[EngineEvent]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    seqs: list[int] = []

    def sink(i: int) -> Callable[[EngineEvent], None]:
        def put(ev: EngineEvent) -> None:
            events[i].append(ev)
            if ev.finished:
                done[i].set()
        return put

    with _hooks(runner, list(forced) if forced is not None else None) as (cuts, cached):
        engine.start()
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                seqs.append(engine.submit(p, sp, sink(i)))
                if not together and not done[i].wait(WAIT_S):
                    raise RuntimeError(f"request {i} did not finish within {WAIT_S:.0f} s")
            if not all(d.wait(WAIT_S) for d in done):
                raise RuntimeError(f"a request did not finish within {WAIT_S:.0f} s")
            engine.check_integrity()
            health = engine.health_tracker
            if health.restarts:  # the supervisor brought the loop back with fresh caches: a step failed
                raise RuntimeError(f"the engine restarted {health.restarts} time(s) while serving the prefix family "
                                   f"(last: {health.last_restart_reason})")
        finally:
            engine.stop()
    out = []
    for i, evs in enumerate(events):
        if evs[-1].error is not None:
            raise RuntimeError(f"request {i} failed: {evs[-1].error}")
        logprobs = [(lp.logprob, lp.top) for e in evs for lp in e.logprobs]
        out.append(Served([t for e in evs for t in e.token_ids], logprobs, cuts[seqs[i]], cached.get(seqs[i], 0)))
    return out


def as_tensors(served: list[Served], with_logprobs: bool) -> dict[str, torch.Tensor]:
    """Per request: its tokens, and (with_logprobs) its chosen and top logprobs, as tensors a bitexact check
    compares."""
    out = {}
    for i, s in enumerate(served):
        out[f"request{i}.tokens"] = torch.tensor(s.tokens, dtype=torch.long)
        if with_logprobs:
            rows = [[lp, *(v for _, v in top)] for lp, top in s.logprobs]
            out[f"request{i}.logprobs"] = torch.tensor(rows, dtype=torch.float32)
            out[f"request{i}.top_ids"] = torch.tensor([[t for t, _ in top] for _, top in s.logprobs])
    return out
