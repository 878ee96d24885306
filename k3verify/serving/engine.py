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

Each turn of the loop schedules step n+1 (decode rows + prompt chunks under max_step_tokens), launches
it (serving/step_loop.py: sampling on the device, CUDA graphs when given) and only then collects step
n's token ids: the host's bookkeeping overlaps the GPU's step instead of following it. With a
speculator, steps run in order (the drafter proposes from the tokens the host holds).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from k3verify.serving.admission import RequestLimits
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
from k3verify.serving.request import Request
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams, TokenLogprob, request_seed
from k3verify.serving.scheduler import Scheduler, StepPlan
from k3verify.serving.scoring import score_prompt
from k3verify.serving.spec.timing import StepTimer
from k3verify.serving.step_loop import LaunchedStep, RowResult, StepLauncher
from k3verify.tokenizer.streaming import IncrementalDecoder

if TYPE_CHECKING:
    from k3verify.serving.spec.step import SpeculativeStep

log = logging.getLogger(__name__)

# The longest a thread that wants the GIL waits before the holder is made to drop it (CPython's default: 5 ms).
# The engine thread gives the GIL up while it waits for a step's results; the HTTP thread then renders and sends
# the previous step's tokens and, at the default, kept the engine from launching the next step for up to 5 ms
# after the GPU was done: a kl-48b-8l step of 64 streams went from launch to launch in 8.2 ms served against
# 4.6 ms in process (H200). Engine.start lowers the interval to this (never raises it).
GIL_SWITCH_S = 0.0005

# Admission hold: requests that arrive together are admitted together. A prefill pass has a large fixed cost that is
# host work (kl-48b-8l on the H200: ~33 ms from launch to launch for 128 to 3k prompt tokens, where the
# GPU needs 3-10 ms), and a burst of arrivals spread over a few tens of milliseconds was admitted over 2-3 such
# steps, each stalling every running stream. So the waiting queue is admitted once no request has arrived for
# ADMIT_QUIET_S, or once its oldest request has waited ADMIT_MAX_HOLD_S, or at once when the waiting requests fill
# every free slot; running rows keep decoding meanwhile. (TGI batches prefills for the same reason with its
# waiting_served_ratio.) A server whose last ADMIT_HISTORY admissions each took one request sees requests come one
# at a time: it admits at once (a hold there only adds its quiet time to every request's TTFT).
# The served bench's bursts (64 or 16 clients whose streams end together) arrived over 27-40 ms with gaps of up to
# 3.4-4.7 ms between requests, hence 5 ms and 40 ms.
ADMIT_QUIET_S = 0.005
ADMIT_MAX_HOLD_S = 0.040
ADMIT_HISTORY = 4

__all__ = ["ContextLengthError", "Engine", "EngineDeadError", "EngineEvent", "InjectedFault"]


class Engine:
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
        self.scheduler = self._new_scheduler()
        self.launcher = StepLauncher(runner, graphs, prefill_graphs)
        self.debug = debug
        self.observer = observer
        self.stall_timeout_s = stall_timeout_s
        self.idle_wait_s = idle_wait_s
        if admit_quiet_s < 0 or admit_max_hold_s < 0:
            raise ValueError(f"admission hold times must be >= 0; got {admit_quiet_s}, {admit_max_hold_s}")
        self.admit_quiet_s, self.admit_max_hold_s = admit_quiet_s, admit_max_hold_s
        self.admitted_sizes: deque[int] = deque(maxlen=ADMIT_HISTORY)  # requests per recent admitting step
        self.num_held = 0  # times the loop waited for more arrivals before admitting (nothing else to run)
        self.health_tracker = EngineHealth(health_policy or HealthPolicy())
        self.num_waiting = 0
        self.num_running = 0
        self.num_steps = 0
        self.num_submitted = 0  # requests queued by submit since start (the served bench waits on it)
        # (launch time, decode rows, prefill tokens) per step while record_steps() is on: the served bench's
        # breakdown of where a wave's wall time goes (bench/served.step_breakdown)
        self.step_log: deque[tuple[float, int, int]] | None = None
        self.arrival_log: deque[float] | None = None  # each request's submit time, under record_steps() too
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._requests: dict[int, Request] = {}
        self._in_flight: LaunchedStep | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._error: str | None = None
        self._fault: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="k3verify-engine", daemon=True)

    def _new_scheduler(self) -> Scheduler:
        """Speculating, each sequence reserves k positions past its need (scheduler.spec_reservation) so that it
        can be verified, or ride along, up to its last token."""
        extra = self.speculator.verifier.num_draft if self.speculator is not None else 0
        return Scheduler(self.runner, max_step_tokens=self.max_step_tokens, max_running=self.max_running,
                         reserve_extra=extra, max_reserve=self.max_context)

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
            self._commands.put(("stop",))
            self._thread.join(timeout)

    def health(self) -> str | None:
        """None while the loop runs, else why not (failed for good, stopped, or a step running past
        stall_timeout_s): what makes requests fail with engine_unavailable."""
        if self._error is not None:
            return self._error
        if not self._thread.is_alive():
            return "engine loop is not running"
        stalled = time.monotonic() - self._heartbeat
        if stalled > self.stall_timeout_s:
            return f"engine loop stalled: no progress for {stalled:.1f}s (limit {self.stall_timeout_s}s)"
        return None

    def status(self) -> HealthStatus:
        """ok / degraded / unhealthy with reasons and counts (what /health reports)."""
        return self.health_tracker.status(self.health())

    def inject_fault(self, message: str = "injected engine fault") -> None:
        """Make the next engine step raise InjectedFault once its admissions are done (the supervisor's test hook)."""
        self._fault = InjectedFault(message)

    def validate(self, prompt_ids: list[int], max_tokens: int) -> None:
        """Raise ValueError/ContextLengthError for a request that could never be served (serving/admission.py)."""
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
            self._commands.put(("add", req))
            self.num_submitted += 1
            if self.arrival_log is not None:
                self.arrival_log.append(req.arrival)
        return req.seq_id

    def abort(self, seq_id: int) -> None:
        """Drop a request (client gone): its cache is released on the engine thread's next turn."""
        self._commands.put(("abort", seq_id))

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run fn on the engine thread between steps (the runner is not thread-safe)."""
        fut: Future[Any] = Future()
        with self._lock:
            if self.health() is not None:
                raise EngineDeadError(f"engine is not running: {self.health()}")
            self._commands.put(("call", fn, fut))
        return fut.result(timeout)

    def score_prompt(self, prompt_ids: list[int], num_top: int, timeout: float = 60.0) -> list[TokenLogprob | None]:
        """Every prompt token's logprob given the tokens before it (None first), by the served model, on the engine
        thread between steps (serving/scoring.py)."""
        result: list[TokenLogprob | None] = self.call(functools.partial(score_prompt, self.runner.model, prompt_ids,
                                                                         num_top), timeout)
        return result

    def check_integrity(self, timeout: float = 60.0) -> None:
        self.call(self.runner.check_integrity, timeout)

    def _run(self) -> None:
        """The supervisor: run the loop; when a step raises, restart it with fresh caches (or give up)."""
        while True:
            try:
                self._loop()
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

    def _loop(self) -> None:
        serving = True
        while serving and self._handle_commands(block=self._is_idle()):
            self._heartbeat = time.monotonic()
            hold = self._admission_hold()
            if hold > 0 and not self.scheduler.running and self._in_flight is None:
                self.num_held += 1
                serving = self._handle_commands(block=True, timeout=hold)  # more arrivals, or the hold ends
                continue
            if not self._is_idle():
                self._step(admit=hold <= 0)
                if self.debug:
                    self.runner.check_integrity()
            self._publish_load()

    def _admission_hold(self) -> float:
        """Seconds the waiting queue's admission should still wait for more arrivals (0: admit now); see
        ADMIT_QUIET_S."""
        waiting = self.scheduler.waiting
        if not waiting or self.admit_quiet_s <= 0:
            return 0.0
        if len(self.admitted_sizes) == ADMIT_HISTORY and max(self.admitted_sizes) == 1:
            return 0.0  # requests come one at a time
        room = self.runner.num_free_slots
        if self.max_running is not None:
            room = min(room, self.max_running - self.scheduler.num_running)
        if len(waiting) >= room:
            return 0.0
        newest, oldest = (self._requests[s.seq_id].arrival for s in (waiting[-1], waiting[0]))
        return max(0.0, min(newest + self.admit_quiet_s, oldest + self.admit_max_hold_s) - time.monotonic())

    def _restart(self, reason: str) -> bool:
        """Fail the admitted requests, reallocate the caches, keep the waiting queue. False: give up."""
        if not self.health_tracker.record_restart(reason):
            return False
        waiting = list(self.scheduler.waiting)
        lost = [r for sid, r in self._requests.items() if sid not in {w.seq_id for w in waiting}]
        self._in_flight = None  # its rows belong to the lost requests
        try:
            self.runner.reset_caches()
        except Exception:
            log.exception("engine restart failed: the caches could not be reallocated")
            return False
        self.scheduler = self._new_scheduler()
        for seq in waiting:
            self.scheduler.add(seq)
        for req in lost:
            self._requests.pop(req.seq_id, None)
            self._emit(req, EngineEvent(error=f"{reason}; this request was in flight and is lost (the engine "
                                              "restarted with fresh caches: retry it)", code="engine_unavailable",
                                        prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids)))
        if self.observer is not None:
            self.observer.count_restart()
        self._heartbeat = time.monotonic()
        log.warning("engine restarted (%d so far): %s", self.health_tracker.restarts, reason)
        return True

    def _handle_commands(self, block: bool, timeout: float | None = None) -> bool:
        try:
            cmd = self._commands.get(timeout=timeout or self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._requests[cmd[1].seq_id] = cmd[1]
                self.scheduler.add(cmd[1])
            elif cmd[0] == "abort":
                self._requests.pop(cmd[1], None)
                self.scheduler.finish(cmd[1])
            elif cmd[0] == "call":
                try:
                    cmd[2].set_result(cmd[1]())
                except Exception as exc:
                    cmd[2].set_exception(exc)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _is_idle(self) -> bool:
        return self.scheduler.is_idle() and self._in_flight is None

    def _step(self, admit: bool = True) -> None:
        """Launch step n+1, then collect step n (whose rows may belong to requests finished since)."""
        if self.speculator is not None and not self._plain_ahead():
            self._step_in_order(admit)
            return
        plan = self._plan(admit)
        previous, self._in_flight = self._in_flight, self.launcher.launch(plan, self._requests) if plan else None
        if previous is not None:
            self._process(previous)
        elif not plan:
            self._refuse_unadmittable_head()
        self.num_steps += 1

    def _step_in_order(self, admit: bool) -> None:
        """With speculative decoding each step is collected before the next is planned: the drafter proposes
        from the tokens the host holds, and a verify pass emits several tokens of a sequence at once."""
        assert self.speculator is not None
        if self._in_flight is not None:  # after launch-ahead steps: the drafter needs every token on the host
            previous, self._in_flight = self._in_flight, None
            self._process(previous)
        plan = self._plan(admit)
        whole = len(plan.decode)
        if plan.decode:
            rest = self.speculator.run(self, plan.decode)  # verifies what it can; the rest decodes plainly
            for seq in plan.decode:
                if seq not in rest and seq.seq_id in self._requests:  # verified and still running
                    seq.num_launched = len(seq.output_ids)
                    self.runner.set_next_tokens([seq.seq_id], [seq.last_token])
            plan.decode = rest
        timed = whole and len(plan.decode) == whole and plan.num_tokens == whole  # the whole batch, no prompt
        # what a plain step of this batch costs the launch-ahead loop (the gate's alternative to a verify), without
        # this in-order step's readback and delivery (spec/timing.py)
        timer = StepTimer(self.runner.device) if timed else None
        with timer.starting_at_replay(self.launcher.graphs) if timer is not None else contextlib.nullcontext():
            launched = self.launcher.launch(plan, self._requests) if plan else None
        if timer is not None:
            timer.launched()
        if launched is not None:
            self._process(launched)
            if timer is not None:
                self.speculator.record_plain_step(whole, timer.seconds())
        elif not plan:
            self._refuse_unadmittable_head()
        self.num_steps += 1

    def _plain_ahead(self) -> bool:
        """With a speculator: whether this step decodes plainly, launching ahead as an engine without one does,
        because the cost gate declines verifies at the coming decode batch size (no drafts are asked for). The
        gate's reprobe (and any change of batch size) brings the in-order speculative step back."""
        assert self.speculator is not None
        batch = sum(s.can_decode for s in self.scheduler.running.values())
        return batch > 0 and self.speculator.plain_ahead(batch)

    def record_steps(self, on: bool) -> None:
        """Start (fresh logs) or stop recording each step's launch time and shape in `step_log` and each request's
        arrival in `arrival_log`."""
        self.step_log = deque(maxlen=1_000_000) if on else None
        self.arrival_log = deque(maxlen=1_000_000) if on else None

    def _plan(self, admit: bool = True) -> StepPlan:
        waiting = len(self.scheduler.waiting)
        plan = self.scheduler.schedule(admit)
        if len(self.scheduler.waiting) < waiting:
            self.admitted_sizes.append(waiting - len(self.scheduler.waiting))
        if self.step_log is not None and plan:
            self.step_log.append((time.monotonic(), len(plan.decode), plan.num_tokens - len(plan.decode)))
        if self._fault is not None:  # after admission, as a runner fault would strike
            fault, self._fault = self._fault, None
            raise fault
        return plan

    def _refuse_unadmittable_head(self) -> None:
        """Nothing ran, nothing runs: the head of the queue can never be admitted (it would wait forever)."""
        if self.scheduler.num_running == 0 and self.scheduler.waiting:
            head = self.scheduler.waiting[0]
            self._finish(self._requests[head.seq_id], EngineEvent(
                error=f"request of {head.num_reserved_tokens} tokens cannot be admitted into an empty cache",
                prompt_tokens=len(head.prompt_ids)))

    def _process(self, step: LaunchedStep) -> None:
        now = time.monotonic()
        for row in self.launcher.collect(step):
            req = self._requests.get(row.seq_id)
            if req is None:
                continue  # finished (stop token, error) or aborted after this step was launched
            if row.nonfinite:
                self._fail_nonfinite(req)
            elif row.error is not None:
                self._fail_request(req, row.error, "sampling_failed")
            else:
                self._deliver(req, row, now)

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
        """Fail a request whose verify pass produced non-finite logits (counted like any other)."""
        self.health_tracker.record_nonfinite()
        if self.observer is not None:
            self.observer.count_nonfinite()
        self._fail_request(req, message, "nonfinite_logits")

    def _finish(self, req: Request, event: EngineEvent) -> None:
        self._requests.pop(req.seq_id, None)
        self.scheduler.finish(req.seq_id)
        event.completion_tokens = len(req.output_ids)
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

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self._error = reason
        pending = list(self._requests.values())
        self._requests.clear()
        self._in_flight = None
        self.scheduler.drain()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                pending.append(cmd[1])
            elif cmd[0] == "call":
                cmd[2].set_exception(EngineDeadError(reason))
        for req in pending:
            self._emit(req, EngineEvent(error=reason, code="engine_unavailable", prompt_tokens=len(req.prompt_ids),
                                        completion_tokens=len(req.output_ids)))
        self._publish_load()
