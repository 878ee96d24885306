"""Drive a running Engine thread from a harness: submit requests, block until each has finished."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.sampler import SamplingParams


def collect_events(engine: Engine, requests: Sequence[tuple[list[int], SamplingParams]], timeout_s: float
                   ) -> list[list[EngineEvent]]:
    """Submit every (prompt, params) to the started `engine` and return each request's events, the last one
    finished. Raises TimeoutError, naming the engine's health, when a request is not finished within timeout_s."""
    events: list[list[EngineEvent]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def sink(i: int) -> Callable[[EngineEvent], None]:
        def put(ev: EngineEvent) -> None:
            events[i].append(ev)
            if ev.finished:
                done[i].set()
        return put

    for i, (prompt, params) in enumerate(requests):
        engine.submit(prompt, params, sink(i))
    if not all(d.wait(timeout_s) for d in done):
        raise TimeoutError(f"a request did not finish within {timeout_s:g} s (engine health: {engine.health()})")
    return events
