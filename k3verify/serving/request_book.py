"""The engine's request book: the live requests by seq_id, the scheduler's queues they sit in, and every event that
reaches their sinks.

Adding and aborting, delivering one token (detokenization, stops, latency observations), finishing, failing one
request alone, and the calls serving/spec/step.py (SpeculativeStep) makes back into the engine (SpecHost). A sink
that raises drops its request only. Runs on the engine thread; serving/engine.py owns one and hands it to the step
loop (serving/engine_loop.py).
"""

from __future__ import annotations

import logging

from k3verify.serving.events import EngineEvent, Observer
from k3verify.serving.health import EngineHealth
from k3verify.serving.request import Request
from k3verify.serving.sampler import TokenLogprob
from k3verify.serving.scheduler import Scheduler
from k3verify.serving.step_loop import RowResult

log = logging.getLogger("k3verify.serving.engine")


class RequestBook:
    """The live requests: each is in `requests` exactly while it is in `scheduler` (waiting or running)."""

    def __init__(self, scheduler: Scheduler, health: EngineHealth, observer: Observer | None = None) -> None:
        self.requests: dict[int, Request] = {}
        self.scheduler = scheduler
        self.health = health
        self.observer = observer
        self.num_waiting = 0  # as last published (publish_load): what /health and the link report
        self.num_running = 0

    def add(self, req: Request) -> None:
        self.requests[req.seq_id] = req
        self.scheduler.add(req)

    def abort(self, seq_id: int) -> None:
        """Drop a request without an event (its client is gone); unknown ids are ignored."""
        self.requests.pop(seq_id, None)
        self.scheduler.finish(seq_id)

    def restart(self, scheduler: Scheduler) -> list[Request]:
        """Move the waiting requests into a fresh scheduler and drop the admitted ones; return those (in flight
        when the engine faulted, their caches gone), for the caller to fail."""
        waiting = list(self.scheduler.waiting)
        kept = {w.seq_id for w in waiting}
        lost = [r for sid, r in self.requests.items() if sid not in kept]
        self.scheduler = scheduler
        for seq in waiting:
            scheduler.add(seq)
        for req in lost:
            self.requests.pop(req.seq_id, None)
        return lost

    def drain(self) -> list[Request]:
        """Empty the book and the scheduler; return every request that was in them."""
        pending = list(self.requests.values())
        self.requests.clear()
        self.scheduler.drain()
        return pending

    def fail_nonfinite(self, req: Request) -> None:
        self._count_nonfinite()
        self.fail_request(req, f"model produced non-finite logits (NaN/inf) at step {len(req.output_ids)}",
                          "nonfinite_logits")

    def deliver(self, req: Request, row: RowResult, now: float) -> None:
        """Detokenization, stops and the sink for one request; a failure there fails it alone."""
        try:
            self._advance(req, row.token, row.logprob, now)
        except Exception as exc:
            log.exception("request %d failed while delivering token %d", req.seq_id, row.token)
            self.fail_request(req, f"internal error while serving this request: {type(exc).__name__}: {exc}",
                              "request_failed")

    def fail_request(self, req: Request, error: str, code: str) -> None:
        if req.seq_id in self.requests:
            self.finish(req, EngineEvent(error=error, code=code, prompt_tokens=len(req.prompt_ids)))

    def finish(self, req: Request, event: EngineEvent) -> None:
        """The request's last event: it leaves the book and the scheduler first."""
        self.requests.pop(req.seq_id, None)
        self.scheduler.finish(req.seq_id)
        event.completion_tokens = len(req.output_ids)
        event.cached_tokens = req.num_cached
        self.emit(req, event)

    def emit(self, req: Request, event: EngineEvent) -> None:
        try:
            req.sink(event)
        except Exception:
            log.exception("sink of request %d failed; dropping the request", req.seq_id)
            if req.seq_id in self.requests:
                self.requests.pop(req.seq_id)
                self.scheduler.finish(req.seq_id)

    def publish_load(self) -> None:
        self.num_waiting, self.num_running = self.scheduler.num_waiting, self.scheduler.num_running
        if self.observer is not None:
            self.observer.set_load(self.num_waiting, self.num_running)

    # ---- SpecHost: what serving/spec/step.py (SpeculativeStep) calls back into ----
    def spec_request(self, seq_id: int) -> Request:
        return self.requests[seq_id]

    def spec_emit(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> bool:
        self._advance(req, token, lp, now)
        return req.seq_id not in self.requests

    def spec_fail(self, req: Request, message: str) -> None:
        """Fail a request whose score pass produced non-finite logits (counted like any other)."""
        self._count_nonfinite()
        self.fail_request(req, message, "nonfinite_logits")

    def _count_nonfinite(self) -> None:
        self.health.record_nonfinite()
        if self.observer is not None:
            self.observer.count_nonfinite()

    def _advance(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> None:
        if self.observer is not None:
            if req.last_token_at is None:
                self.observer.observe_ttft(now - req.arrival)
            else:
                self.observer.observe_inter_token(now - req.last_token_at)
        req.last_token_at = now
        delta, finish = req.append(token)
        event = EngineEvent(text=delta, token_ids=[token], logprobs=[lp] if lp else [], finish_reason=finish,
                            prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids))
        if finish is not None:
            self.finish(req, event)
        else:
            self.emit(req, event)
