"""The Engine's parts on their own, without its thread: the request book (live requests and their sinks), the
admission hold (how long to wait for company) and the step loop (commands in, steps out, on the calling thread)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from server_fakes import EOS, MODEL_VOCAB, ByteTokenizer, FakeRunner, _Slot

from k3verify.serving.admission_hold import ADMIT_HISTORY, AdmissionHold
from k3verify.serving.engine_loop import EngineLoop
from k3verify.serving.events import EngineDeadError, EngineEvent, TokenText
from k3verify.serving.health import EngineHealth, HealthPolicy
from k3verify.serving.request import Request
from k3verify.serving.request_book import RequestBook
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.scheduler import Scheduler
from k3verify.serving.step_loop import RowResult, StepLauncher
from k3verify.tokenizer.streaming import IncrementalDecoder

TEXT = TokenText(ByteTokenizer())  # type: ignore[arg-type]


class OneHotRunner(FakeRunner):
    """Always samples token 97 ("a") greedily: the events are known in advance."""

    def logits_for(self, slot: _Slot) -> torch.Tensor:
        row = torch.full((MODEL_VOCAB,), -5.0)
        row[97] = 5.0
        return row


def request(seq_id: int, sink: Any, max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(seq_id=seq_id, prompt_ids=[1, 2, 3], max_new_tokens=max_tokens, params=params, sink=sink,
                   stop_ids=frozenset({EOS}), seed=seq_id, decoder=IncrementalDecoder(TEXT, skip_special=True),
                   arrival=time.monotonic())


def book_of(runner: FakeRunner) -> RequestBook:
    return RequestBook(Scheduler(runner, max_step_tokens=64), EngineHealth(HealthPolicy()))  # type: ignore[arg-type]


def test_book_holds_a_request_exactly_while_the_scheduler_does() -> None:
    """add puts a request in both, abort and finish take it out of both; an unknown abort is ignored."""
    book, events = book_of(FakeRunner()), []
    for sid in (1, 2, 3):
        book.add(request(sid, events.append))
    book.abort(2)
    book.abort(99)
    book.finish(book.requests[3], EngineEvent(finish_reason="stop"))
    assert list(book.requests) == [1] and [s.seq_id for s in book.scheduler.waiting] == [1]
    assert [e.finish_reason for e in events] == ["stop"], "only finish sends an event"


def test_a_raising_sink_drops_only_its_request() -> None:
    """A sink that raises takes its request out of the book and the scheduler; the other request's sink still
    gets its event (control: the same event to a sink that does not raise keeps its request)."""
    book, got = book_of(FakeRunner()), []

    def broken(event: EngineEvent) -> None:
        raise RuntimeError("client gone")

    book.add(request(1, broken))
    book.add(request(2, got.append))
    for sid in (1, 2):
        book.deliver(book.requests[sid], RowResult(seq_id=sid, token=97, nonfinite=False, logprob=None), 0.0)
    assert list(book.requests) == [2] and [s.seq_id for s in book.scheduler.waiting] == [2]
    assert [e.text for e in got] == ["a"]


def test_book_restart_keeps_the_waiting_and_returns_the_admitted() -> None:
    """After a fault, the admitted request (its cache is gone) is returned to be failed; the waiting one moves to
    the fresh scheduler and stays in the book."""
    runner = FakeRunner()
    book = book_of(runner)
    book.add(request(1, print))
    book.scheduler.schedule()  # admits 1
    book.add(request(2, print))
    fresh = Scheduler(runner, max_step_tokens=64)  # type: ignore[arg-type]
    lost = book.restart(fresh)
    assert [r.seq_id for r in lost] == [1]
    assert book.scheduler is fresh and [s.seq_id for s in fresh.waiting] == [2] and list(book.requests) == [2]


def test_nonfinite_logits_fail_their_request_and_are_counted() -> None:
    """fail_nonfinite and spec_fail end the request with code nonfinite_logits and count once each."""
    book, events = book_of(FakeRunner()), []
    book.add(request(1, events.append))
    book.add(request(2, events.append))
    book.fail_nonfinite(book.requests[1])
    book.spec_fail(book.requests[2], "non-finite in a score pass")
    assert [e.code for e in events] == ["nonfinite_logits"] * 2 and not book.requests
    assert book.health.nonfinite_failures == 2


def test_spec_emit_says_when_the_request_ended() -> None:
    """spec_emit returns False while the request runs and True on its last token (max_tokens 2)."""
    book = book_of(FakeRunner())
    book.add(request(1, lambda e: None, max_tokens=2))
    req = book.spec_request(1)
    assert [book.spec_emit(req, 97, None, 0.0), book.spec_emit(req, 97, None, 0.0)] == [False, True]


def test_admission_hold_waits_for_quiet_and_caps_at_the_longest_hold() -> None:
    """Two waiting, room for eight: the hold ends quiet_s after the newest arrival, never later than max_hold_s
    after the oldest; a burst that fills the room goes at once."""
    hold = AdmissionHold(quiet_s=0.005, max_hold_s=0.040)
    assert hold.seconds(2, 8, oldest_arrival=0.0, newest_arrival=0.010, now=0.012) == pytest.approx(0.003)
    assert hold.seconds(2, 8, oldest_arrival=0.0, newest_arrival=0.038, now=0.012) == pytest.approx(0.028)
    assert hold.seconds(2, 8, oldest_arrival=0.0, newest_arrival=0.010, now=0.5) == 0.0
    assert hold.seconds(8, 8, oldest_arrival=0.0, newest_arrival=0.010, now=0.012) == 0.0
    assert AdmissionHold(0.0, 0.040).seconds(2, 8, 0.0, 0.010, now=0.012) == 0.0


def test_admission_hold_learns_that_requests_come_one_at_a_time() -> None:
    """After ADMIT_HISTORY admissions of one request each it admits at once; one admission of two brings the hold
    back."""
    hold = AdmissionHold(quiet_s=0.005, max_hold_s=0.040)
    for _ in range(ADMIT_HISTORY - 1):
        hold.record_admitted(1)
    assert hold.seconds(1, 8, 0.0, 0.0, now=0.001) > 0, "the history is too short to skip the hold"
    hold.record_admitted(1)
    assert hold.seconds(1, 8, 0.0, 0.0, now=0.001) == 0.0
    hold.record_admitted(2)
    assert hold.seconds(1, 8, 0.0, 0.0, now=0.001) > 0
    with pytest.raises(ValueError, match="-1"):
        AdmissionHold(-1.0, 0.040)


def loop_of(runner: FakeRunner, **kw: Any) -> EngineLoop:
    return EngineLoop(book_of(runner), runner, StepLauncher(runner), AdmissionHold(0.0, 0.0), **kw)  # type: ignore[arg-type]


def test_loop_runs_requests_to_their_end_on_the_calling_thread() -> None:
    """Two added requests each get max_tokens "a" tokens and finish by length; the loop returns at the stop
    command their sinks queue, leaving the book, the scheduler and the runner's slots empty."""
    runner = OneHotRunner()
    loop = loop_of(runner, debug=True)
    events: dict[int, list[EngineEvent]] = {1: [], 2: []}

    def sink(sid: int) -> Any:
        def take(event: EngineEvent) -> None:
            events[sid].append(event)
            if all(evs and evs[-1].finished for evs in events.values()):
                loop.commands.put(("stop",))
        return take

    for sid in (1, 2):
        loop.commands.put(("add", request(sid, sink(sid))))
    loop.run()
    for evs in events.values():
        assert "".join(e.text for e in evs) == "aaa" and evs[-1].finish_reason == "length"
    assert not loop.book.requests and loop.scheduler.is_idle() and not runner.slots and loop.num_steps >= 3


def test_an_injected_fault_strikes_after_admission() -> None:
    """inject_fault makes the next step raise once it has admitted the waiting request (as a runner fault
    would); the loop does not swallow it."""
    loop = loop_of(OneHotRunner())
    loop.commands.put(("add", request(1, lambda e: loop.commands.put(("stop",)) if e.finished else None)))
    loop.inject_fault(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        loop.run()
    assert list(loop.scheduler.running) == [1]


def test_drain_commands_returns_queued_requests_and_fails_queued_calls() -> None:
    """What was queued for a loop that is gone: the requests come back, the calls raise EngineDeadError."""
    loop = loop_of(FakeRunner())
    fut: Future[Any] = Future()
    queued = request(1, lambda e: None)
    loop.commands.put(("add", queued))
    loop.commands.put(("call", lambda: 1, fut))
    assert loop.drain_commands("engine stopped") == [queued]
    with pytest.raises(EngineDeadError, match="engine stopped"):
        fut.result(0)
