"""The serving engine: one thread drives the ModelRunner (continuous batching, sampling, stops).

Callers `submit` a prompt with a `sink`; the engine thread calls the sink with one EngineEvent per
generated token (text delta, logprobs) and a final event carrying finish_reason or error.

No single request can end the loop: sampling parameters are range-checked at submit, sampling is
numerically safe (serving/sampler.py), and a failure while sampling, detokenizing or delivering one
request fails that request only. Non-finite logits fail their request with the reason and are counted
(serving/health.py). Anything else escaping a step (a runner fault; tests inject one with
`inject_fault`) is handled by the supervisor: the admitted requests fail with a clear error, the
caches are reallocated, waiting requests stay queued, and the restart is counted; past
`HealthPolicy.max_restarts` restarts in the window it gives up and the loop stays dead.

The Engine holds its parts: a RequestBook (serving/request_book.py: the live requests, their scheduler and every
event that reaches their sinks), an EngineLoop (serving/engine_loop.py: commands, launching and collecting steps)
with its AdmissionHold (serving/admission_hold.py) and StepLauncher, and the RequestLimits checked at submit. This
module is the public API called from any thread, and the supervisor.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from k3verify.serving.admission_hold import ADMIT_HISTORY, ADMIT_MAX_HOLD_S, ADMIT_QUIET_S, AdmissionHold
from k3verify.serving.engine_loop import EngineLoop
from k3verify.serving.events import (
    ContextLengthError,
    EngineDeadError,
    EngineEvent,
    InjectedFault,
    Observer,
    Tokenizer,
    TokenText,
)
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.health import EngineHealth, HealthPolicy, HealthStatus
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.prompt_logprobs import prompt_logprobs
from k3verify.serving.request import Request
from k3verify.serving.request_book import RequestBook
from k3verify.serving.request_limits import RequestLimits
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams, TokenLogprob, request_seed
from k3verify.serving.scheduler import Scheduler
from k3verify.serving.step_loop import StepLauncher
from k3verify.tokenizer.streaming import IncrementalDecoder

if TYPE_CHECKING:
    from k3verify.serving.spec.step import SpeculativeStep

log = logging.getLogger(__name__)

# The longest a thread that wants the GIL waits before the holder is made to drop it (CPython's default: 5 ms).
# The engine thread gives the GIL up while it waits for a step's results; the HTTP thread then renders and sends
# the previous step's tokens and, at the default, can keep the engine from launching the next step for up to 5 ms
# after the GPU is done, longer than a decode step of a large batch takes on the GPU. Engine.start lowers the
# interval to this (never raises it).
GIL_SWITCH_S = 0.0005


__all__ = ["ADMIT_HISTORY", "ADMIT_MAX_HOLD_S", "ADMIT_QUIET_S", "ContextLengthError", "Engine", "EngineDeadError",
           "EngineEvent", "InjectedFault"]


class Engine:
    """Continuous batching on one engine thread; submit, abort and call from any thread."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, eos_token_ids: Collection[int], vocab_size: int,
                 max_step_tokens: int = 2048, max_running: int | None = None, graphs: GraphDecoder | None = None,
                 debug: bool = False, observer: Observer | None = None, stall_timeout_s: float = 120.0,
                 idle_wait_s: float = 0.05, health_policy: HealthPolicy | None = None,
                 speculator: SpeculativeStep | None = None, admit_quiet_s: float = ADMIT_QUIET_S,
                 admit_max_hold_s: float = ADMIT_MAX_HOLD_S, prefill_graphs: GraphPrefill | None = None) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids must name at least one id (config eos and generation eos)")
        if graphs is not None and graphs.buckets[-1] < (max_running or runner.state_pool.num_slots):
            raise ValueError(f"graph buckets {graphs.buckets} do not cover a decode batch of "
                             f"{max_running or runner.state_pool.num_slots} sequences (max_running, else every "
                             f"state slot)")
        self.runner = runner
        # Decoding through graphs, a sequence's whole budget must fit their (possibly shorter) context.
        self.max_context = runner.max_context if graphs is None else min(runner.max_context, graphs.max_context)
        self.limits = RequestLimits.of(runner, vocab_size, self.max_context)
        self.token_text = TokenText(tokenizer)
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.vocab_size = vocab_size
        self.max_step_tokens, self.max_running = max_step_tokens, max_running
        self.speculator = speculator  # None: plain decode only (serve --speculative turns it on)
        self.observer = observer
        self.stall_timeout_s = stall_timeout_s
        self.health_tracker = EngineHealth(health_policy or HealthPolicy())
        self.book = RequestBook(self._new_scheduler(), self.health_tracker, observer)
        self.loop = EngineLoop(self.book, runner, StepLauncher(runner, graphs, prefill_graphs),
                               AdmissionHold(admit_quiet_s, admit_max_hold_s), speculator=speculator,
                               max_running=max_running, debug=debug, idle_wait_s=idle_wait_s)
        self.num_submitted = 0  # requests queued by submit since start (the served bench waits on it)
        self.arrival_log: deque[float] | None = None  # each request's submit time, under record_steps()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="k3verify-engine", daemon=True)

    def _new_scheduler(self) -> Scheduler:
        """Speculating, each sequence reserves k positions past its need (scheduler.spec_reservation) so that it
        can be scored, or ride along, up to its last token."""
        extra = self.speculator.scorer.num_draft if self.speculator is not None else 0
        return Scheduler(self.runner, max_step_tokens=self.max_step_tokens, max_running=self.max_running,
                         reserve_extra=extra, max_reserve=self.max_context)

    # the parts' state that callers read (bench, /health, tests)
    @property
    def scheduler(self) -> Scheduler:
        return self.book.scheduler

    @property
    def launcher(self) -> StepLauncher:
        return self.loop.launcher

    @property
    def admission(self) -> AdmissionHold:
        return self.loop.admission

    @property
    def num_waiting(self) -> int:
        return self.book.num_waiting

    @property
    def num_running(self) -> int:
        return self.book.num_running

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    @property
    def num_held(self) -> int:
        return self.loop.num_held

    @property
    def step_log(self) -> deque[tuple[float, int, int]] | None:
        """(launch time, decode rows, prefill tokens) per step while record_steps() is on."""
        return self.loop.step_log

    def start(self) -> Engine:
        if sys.getswitchinterval() > GIL_SWITCH_S:
            log.info("GIL switch interval %.4f s -> %.4f s (the engine thread waits less for the HTTP thread)",
                     sys.getswitchinterval(), GIL_SWITCH_S)
            sys.setswitchinterval(GIL_SWITCH_S)
        if self.observer is not None and self.speculator is not None:
            self.observer.watch_speculation(self.speculator.counters)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.commands.put(("stop",))
            self._thread.join(timeout)

    def health(self) -> str | None:
        """None while the loop runs, else why not (failed for good, stopped, or a step running past
        stall_timeout_s): what makes requests fail with engine_unavailable."""
        if self._error is not None:
            return self._error
        if not self._thread.is_alive():
            return "engine loop is not running"
        stalled = time.monotonic() - self.loop.heartbeat
        if stalled > self.stall_timeout_s:
            return f"engine loop stalled: no progress for {stalled:.1f}s (limit {self.stall_timeout_s}s)"
        return None

    def status(self) -> HealthStatus:
        """ok / degraded / unhealthy with reasons and counts (what /health reports)."""
        return self.health_tracker.status(self.health())

    def inject_fault(self, message: str = "injected engine fault") -> None:
        """Make the next engine step raise InjectedFault once its admissions are done (the supervisor's test hook)."""
        self.loop.inject_fault(InjectedFault(message))

    def validate(self, prompt_ids: list[int], max_tokens: int) -> None:
        """Raise ValueError/ContextLengthError for a request that could never be served (serving/request_limits.py)."""
        self.limits.check(prompt_ids, max_tokens)

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """The longest completion that could ever follow a prompt_len-token prompt (0: the prompt alone is too long)."""
        return self.limits.longest_completion(prompt_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[EngineEvent], None]) -> int:
        """Queue a request; returns its seq_id. Raises ValueError/ContextLengthError/EngineDeadError."""
        self.limits.check_submission(prompt_ids, params)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        req = Request(seq_id=next(self._ids), prompt_ids=list(prompt_ids), max_new_tokens=params.max_tokens,
                      params=params, sink=sink, stop_ids=frozenset(stop_ids), seed=request_seed(params.seed),
                      decoder=IncrementalDecoder(self.token_text, skip_special=True),
                      arrival=time.monotonic())
        with self._lock:
            if self.health() is not None:
                raise EngineDeadError(f"engine is not running: {self.health()}")
            self.loop.commands.put(("add", req))
            self.num_submitted += 1
            if self.arrival_log is not None:
                self.arrival_log.append(req.arrival)
        return req.seq_id

    def abort(self, seq_id: int) -> None:
        """Drop a request (client gone): its cache is released on the engine thread's next turn."""
        self.loop.commands.put(("abort", seq_id))

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run fn on the engine thread between steps (the runner is not thread-safe)."""
        fut: Future[Any] = Future()
        with self._lock:
            if self.health() is not None:
                raise EngineDeadError(f"engine is not running: {self.health()}")
            self.loop.commands.put(("call", fn, fut))
        return fut.result(timeout)

    def prompt_logprobs(self, prompt_ids: list[int], num_top: int, timeout: float = 60.0) -> list[TokenLogprob | None]:
        """Every prompt token's logprob given the tokens before it (None first), by the served model, on the engine
        thread between steps (serving/prompt_logprobs.py)."""
        result: list[TokenLogprob | None] = self.call(
            functools.partial(prompt_logprobs, self.runner.model, prompt_ids, num_top), timeout)
        return result

    def check_integrity(self, timeout: float = 60.0) -> None:
        self.call(self.runner.check_integrity, timeout)

    def record_steps(self, on: bool) -> None:
        """Start (fresh logs) or stop recording each step's launch time and shape in `step_log` and each request's
        arrival in `arrival_log`."""
        self.loop.step_log = deque(maxlen=1_000_000) if on else None
        self.arrival_log = deque(maxlen=1_000_000) if on else None

    def _run(self) -> None:
        """The supervisor: run the loop; when a step raises, restart it with fresh caches (or give up)."""
        while True:
            try:
                self.loop.run()
            except Exception as exc:
                log.exception("engine loop failed")
                reason = f"engine fault: {type(exc).__name__}: {exc}"
                if self._restart(reason):
                    continue
                self._fail_all(f"{reason}; the engine gave up after {self.health_tracker.restarts} restart(s) "
                               f"within {self.health_tracker.policy.window_s:g}s")
                return
            self._fail_all("engine stopped")
            return

    def _restart(self, reason: str) -> bool:
        """Fail the admitted requests, reallocate the caches, keep the waiting queue. False: give up."""
        if not self.health_tracker.record_restart(reason):
            return False
        self.loop.in_flight = None  # its rows belong to the requests lost below
        try:
            self.runner.reset_caches()
        except Exception:
            log.exception("engine restart failed: the caches could not be reallocated")
            return False
        for req in self.book.restart(self._new_scheduler()):
            self.book.emit(req, EngineEvent(error=f"{reason}; this request was in flight and is lost (the engine "
                                              "restarted with fresh caches: retry it)", code="engine_unavailable",
                                        prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids)))
        if self.observer is not None:
            self.observer.count_restart()
        self.loop.heartbeat = time.monotonic()
        log.warning("engine restarted (%d so far): %s", self.health_tracker.restarts, reason)
        return True

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self._error = reason
        self.loop.in_flight = None
        pending = self.book.drain() + self.loop.drain_commands(reason)
        for req in pending:
            self.book.emit(req, EngineEvent(error=reason, code="engine_unavailable", prompt_tokens=len(req.prompt_ids),
                                        completion_tokens=len(req.output_ids)))
        self.book.publish_load()
