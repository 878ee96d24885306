"""The engine's request bookkeeping: the live requests by seq_id and every event that reaches their sinks.

Delivering one token (detokenization, stops, latency observations), finishing, failing one request alone, and the
calls serving/spec/step.py (SpeculativeStep) makes back into the engine. A sink that raises drops its request only.
Runs on the engine thread; serving/engine.py composes it with the step loop.
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
    """The engine's live requests (Engine.__init__ sets the state declared here)."""

    _requests: dict[int, Request]
    scheduler: Scheduler
    observer: Observer | None
    health_tracker: EngineHealth
    num_waiting: int
    num_running: int

    def _fail_nonfinite(self, req: Request) -> None:
        self.health_tracker.record_nonfinite()
        if self.observer is not None:
            self.observer.count_nonfinite()
        self._fail_request(req, f"model produced non-finite logits (NaN/inf) at step {len(req.output_ids)}",
                           "nonfinite_logits")

    def _deliver(self, req: Request, row: RowResult, now: float) -> None:
        """Detokenization, stops and the sink for one request; a failure there fails it alone."""
        try:
            self._advance(req, row.token, row.logprob, now)
        except Exception as exc:
            log.exception("request %d failed while delivering token %d", req.seq_id, row.token)
            self._fail_request(req, f"internal error while serving this request: {type(exc).__name__}: {exc}",
                               "request_failed")

    def _fail_request(self, req: Request, error: str, code: str) -> None:
        if req.seq_id in self._requests:
            self._finish(req, EngineEvent(error=error, code=code, prompt_tokens=len(req.prompt_ids)))

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
            self._finish(req, event)
        else:
            self._emit(req, event)


    # ---- what serving/spec/step.py (SpeculativeStep) calls back into ----
    def spec_request(self, seq_id: int) -> Request:
        return self._requests[seq_id]

    def spec_emit(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> bool:
        self._advance(req, token, lp, now)
        return req.seq_id not in self._requests

    def spec_fail(self, req: Request, message: str) -> None:
        """Fail a request whose score pass produced non-finite logits (counted like any other)."""
        self.health_tracker.record_nonfinite()
        if self.observer is not None:
            self.observer.count_nonfinite()
        self._fail_request(req, message, "nonfinite_logits")

    def _finish(self, req: Request, event: EngineEvent) -> None:
        self._requests.pop(req.seq_id, None)
        self.scheduler.finish(req.seq_id)
        event.completion_tokens = len(req.output_ids)
        event.cached_tokens = req.num_cached
        self._emit(req, event)

    def _emit(self, req: Request, event: EngineEvent) -> None:
        try:
            req.sink(event)
        except Exception:
            log.exception("sink of request %d failed; dropping the request", req.seq_id)
            if req.seq_id in self._requests:
                self._requests.pop(req.seq_id)
                self.scheduler.finish(req.seq_id)

    def _publish_load(self) -> None:
        self.num_waiting, self.num_running = self.scheduler.num_waiting, self.scheduler.num_running
        if self.observer is not None:
            self.observer.set_load(self.num_waiting, self.num_running)
