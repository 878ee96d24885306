"""The engine's step loop: commands, the admission hold, launching step n+1 before collecting step n.

Each turn schedules step n+1 (decode rows + prompt chunks under max_step_tokens), launches it (serving/step_loop.py:
sampling on the device, CUDA graphs when given) and only then collects step n's token ids: the host's bookkeeping
overlaps the GPU's step instead of following it. With a speculator, steps run in order (the drafter proposes from
the tokens the host holds) unless the cost policy declines speculation at this batch size. Runs on the engine
thread; the requests it steps are a RequestBook's (serving/request_book.py), and serving/engine.py owns both.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from k3verify.serving.admission_hold import AdmissionHold
from k3verify.serving.events import EngineDeadError, EngineEvent
from k3verify.serving.request import Request
from k3verify.serving.request_book import RequestBook
from k3verify.serving.runner import ModelRunner
from k3verify.serving.scheduler import Scheduler, StepPlan
from k3verify.serving.spec.step_timer import StepTimer
from k3verify.serving.step_loop import LaunchedStep, StepLauncher

if TYPE_CHECKING:
    from k3verify.serving.spec.step import SpeculativeStep


class EngineLoop:
    """The engine thread's loop over steps: it takes commands (add, abort, call, stop) from `commands`, holds
    admission, and launches and collects the book's steps."""

    def __init__(self, book: RequestBook, runner: ModelRunner, launcher: StepLauncher, admission: AdmissionHold, *,
                 speculator: SpeculativeStep | None = None, max_running: int | None = None, debug: bool = False,
                 idle_wait_s: float = 0.05) -> None:
        self.book, self.runner, self.launcher, self.admission = book, runner, launcher, admission
        self.speculator = speculator
        self.max_running = max_running
        self.debug = debug
        self.idle_wait_s = idle_wait_s
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.in_flight: LaunchedStep | None = None  # launched, not yet collected
        self.heartbeat = time.monotonic()  # the start of the latest turn (what a stall is measured from)
        self.num_held = 0  # times the loop waited for more arrivals before admitting (nothing else to run)
        self.num_steps = 0
        # (launch time, decode rows, prefill tokens) per step while on (Engine.record_steps): the served bench's
        # breakdown of where a wave's wall time goes (bench/served.step_breakdown)
        self.step_log: deque[tuple[float, int, int]] | None = None
        self._fault: BaseException | None = None

    @property
    def scheduler(self) -> Scheduler:
        """The book's scheduler (a restart gives the book a fresh one)."""
        return self.book.scheduler

    def inject_fault(self, fault: BaseException) -> None:
        """Make the next step raise `fault` once its admissions are done."""
        self._fault = fault

    def drain_commands(self, reason: str) -> list[Request]:
        """The loop is gone: fail the queued calls with EngineDeadError(reason); return the queued requests."""
        added: list[Request] = []
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return added
            if cmd[0] == "add":
                added.append(cmd[1])
            elif cmd[0] == "call":
                cmd[2].set_exception(EngineDeadError(reason))

    def run(self) -> None:
        """Turn until a stop command; a fault escaping a step propagates to the caller (the engine's supervisor)."""
        serving = True
        while serving and self._handle_commands(block=self._is_idle()):
            self.heartbeat = time.monotonic()
            hold = self._admission_hold()
            if hold > 0 and not self.scheduler.running and self.in_flight is None:
                self.num_held += 1
                serving = self._handle_commands(block=True, timeout=hold)  # more arrivals, or the hold ends
                continue
            if not self._is_idle():
                self._step(admit=hold <= 0)
                if self.debug:
                    self.runner.check_integrity()
            self.book.publish_load()

    def _admission_hold(self) -> float:
        """Seconds the waiting queue's admission should still wait for more arrivals (0: admit now)."""
        waiting = self.scheduler.waiting
        if not waiting:
            return 0.0
        room = self.runner.num_free_slots
        if self.max_running is not None:
            room = min(room, self.max_running - self.scheduler.num_running)
        oldest, newest = (self.book.requests[s.seq_id].arrival for s in (waiting[0], waiting[-1]))
        return self.admission.seconds(len(waiting), room, oldest, newest)

    def _handle_commands(self, block: bool, timeout: float | None = None) -> bool:
        try:
            cmd = self.commands.get(timeout=timeout or self.idle_wait_s) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self.book.add(cmd[1])
            elif cmd[0] == "abort":
                self.book.abort(cmd[1])
            elif cmd[0] == "call":
                try:
                    cmd[2].set_result(cmd[1]())
                except Exception as exc:
                    cmd[2].set_exception(exc)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _is_idle(self) -> bool:
        return self.scheduler.is_idle() and self.in_flight is None

    def _step(self, admit: bool = True) -> None:
        """Launch step n+1, then collect step n (whose rows may belong to requests finished since)."""
        if self.speculator is not None and not self._plain_ahead():
            self._step_in_order(admit)
            return
        plan = self._plan(admit)
        previous, self.in_flight = self.in_flight, self.launcher.launch(plan, self.book.requests) if plan else None
        if previous is not None:
            self._process(previous)
        elif not plan:
            self._refuse_unadmittable_head()
        self.num_steps += 1

    def _step_in_order(self, admit: bool) -> None:
        """With speculative decoding each step is collected before the next is planned: the drafter proposes
        from the tokens the host holds, and a score pass emits several tokens of a sequence at once."""
        assert self.speculator is not None
        if self.in_flight is not None:  # after launch-ahead steps: the drafter needs every token on the host
            previous, self.in_flight = self.in_flight, None
            self._process(previous)
        plan = self._plan(admit)
        whole = len(plan.decode)
        if plan.decode:
            rest = self.speculator.run(self.book, plan.decode)  # scores what it can; the rest decodes plainly
            for seq in plan.decode:
                if seq not in rest and seq.seq_id in self.book.requests:  # scored and still running
                    seq.num_launched = len(seq.output_ids)
                    self.runner.set_next_tokens([seq.seq_id], [seq.last_token])
            plan.decode = rest
        timed = whole and len(plan.decode) == whole and plan.num_tokens == whole  # the whole batch, no prompt
        # what a plain step of this batch costs the launch-ahead loop (the cost policy's alternative to a score pass),
        # without this in-order step's readback and delivery (spec/step_timer.py)
        timer = StepTimer(self.runner.device) if timed else None
        with timer.starting_at_replay(self.launcher.graphs) if timer is not None else contextlib.nullcontext():
            launched = self.launcher.launch(plan, self.book.requests) if plan else None
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
        because the cost policy declines scores at the coming decode batch size (no drafts are asked for). The
        cost policy's reprobe (and any change of batch size) brings the in-order speculative step back."""
        assert self.speculator is not None
        batch = sum(s.can_decode for s in self.scheduler.running.values())
        return batch > 0 and self.speculator.plain_ahead(batch)

    def _plan(self, admit: bool = True) -> StepPlan:
        waiting = len(self.scheduler.waiting)
        plan = self.scheduler.schedule(admit)
        if len(self.scheduler.waiting) < waiting:
            self.admission.record_admitted(waiting - len(self.scheduler.waiting))
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
            self.book.finish(self.book.requests[head.seq_id], EngineEvent(
                error=f"request of {head.num_reserved_tokens} tokens cannot be admitted into an empty cache",
                prompt_tokens=len(head.prompt_ids)))

    def _process(self, step: LaunchedStep) -> None:
        now = time.monotonic()
        for row in self.launcher.collect(step):
            req = self.book.requests.get(row.seq_id)
            if req is None:
                continue  # finished (stop token, error) or aborted after this step was launched
            if row.nonfinite:
                self.book.fail_nonfinite(req)
            elif row.error is not None:
                self.book.fail_request(req, row.error, "sampling_failed")
            else:
                self.book.deliver(req, row, now)
