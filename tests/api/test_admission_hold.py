"""The engine's admission hold (admission.ADMIT_QUIET_S): requests arriving together are prefilled in one step;
a stream of arrivals is still admitted within the longest hold; a burst that fills every free slot goes at once.
Each check has its control (the hold off, or one more free slot)."""

from __future__ import annotations

import threading
import time

from server_harness import RecordingRunner, make_tiny_runner, tiny_parts

from k3verify.serving.engine import ADMIT_HISTORY, Engine, EngineEvent
from k3verify.serving.sampler import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _engine(runner: RecordingRunner, **kw: float | int) -> Engine:
    cfg, _, tok = tiny_parts()
    return Engine(runner, tok, eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size, **kw).start()


def _submit_spaced(engine: Engine, n: int, gap_s: float) -> list[threading.Event]:
    done = [threading.Event() for _ in range(n)]
    for i in range(n):
        engine.submit([1 + i, 2, 3], PARAMS, lambda ev, d=done[i]: d.set() if ev.finished else None)
        time.sleep(gap_s)
    return done


def _first_prefill(quiet: float, max_hold: float, n: int, gap_s: float, delay_s: float = 0.05) -> list[int]:
    runner = RecordingRunner(make_tiny_runner(), delay_s=delay_s)  # every step slow: later arrivals land mid-step
    engine = _engine(runner, admit_quiet_s=quiet, admit_max_hold_s=max_hold)
    try:
        done = _submit_spaced(engine, n, gap_s)
        assert all(d.wait(60) for d in done)
    finally:
        engine.stop()
    return runner.prefill_sizes


def test_a_burst_is_prefilled_in_one_step() -> None:
    """Four requests 10 ms apart: one prefill of four with the hold; without it (control; 50 ms apart, steps of
    200 ms) the first goes alone and the others wait for the next step. Gaps and holds are wide for a loaded CI."""
    assert _first_prefill(0.2, 1.0, 4, 0.01)[0] == 4
    assert _first_prefill(0.0, 0.0, 4, 0.05, delay_s=0.2)[0] == 1, "control: without the hold the burst is split"


def test_a_steady_stream_is_admitted_within_the_longest_hold() -> None:
    """Arrivals every 50 ms never leave a quiet gap of 200 ms, yet the first prefill starts by the 500 ms hold:
    it holds more than one request and not all twenty."""
    first = _first_prefill(0.2, 0.5, 20, 0.05)[0]
    assert 2 <= first < 20, first


def test_a_burst_that_fills_every_free_slot_is_admitted_at_once() -> None:
    """Two requests queued while the engine is busy, with max_running 2: admitted without holding; with room for
    a third (control) the engine holds for more arrivals first."""
    for max_running, held in ((2, False), (3, True)):
        engine = _engine(RecordingRunner(make_tiny_runner()), admit_quiet_s=0.05, admit_max_hold_s=0.2,
                         max_running=max_running)
        try:
            release = threading.Event()
            holder = threading.Thread(target=engine.call, args=(lambda r=release: r.wait(10),), daemon=True)
            holder.start()
            time.sleep(0.05)  # the engine thread is inside the call
            events: list[list[EngineEvent]] = [[], []]
            done = [threading.Event(), threading.Event()]
            for i in range(2):
                engine.submit([5, 6, i], PARAMS,
                              lambda ev, e=events[i], d=done[i]: (e.append(ev), d.set() if ev.finished else None))
            release.set()
            assert all(d.wait(30) for d in done)
            assert (engine.num_held > 0) == held, (max_running, engine.num_held)
        finally:
            engine.stop()


def test_requests_that_come_one_at_a_time_are_not_held() -> None:
    """Sequential requests (each sent once the previous ended): once ADMIT_HISTORY admissions each took one
    request, the engine admits the next at once, where a hold would only add its quiet time to every TTFT.
    Control: once a burst has been admitted as more than one request, a lone request is held again."""
    engine = _engine(RecordingRunner(make_tiny_runner(), delay_s=0.05), admit_quiet_s=0.03, admit_max_hold_s=0.2)
    try:
        for i in range(ADMIT_HISTORY + 2):
            held = engine.num_held
            assert _submit_spaced(engine, 1, 0.0)[0].wait(30)
            if i < ADMIT_HISTORY:
                assert engine.num_held > held, f"request {i}: the history is too short to skip the hold"
            else:
                assert engine.num_held == held, f"request {i}: held though requests come one at a time"
        assert list(engine.admission.admitted_sizes) == [1] * ADMIT_HISTORY
        # a burst: its first request goes at once (the history says one at a time) and the other two, arriving
        # during that 50 ms step, are admitted together
        assert all(d.wait(30) for d in _submit_spaced(engine, 3, 0.002))
        assert list(engine.admission.admitted_sizes)[-2:] == [1, 2], list(engine.admission.admitted_sizes)
        held = engine.num_held
        assert _submit_spaced(engine, 1, 0.0)[0].wait(30)
        assert engine.num_held > held, "control: after a burst, a lone request is held for company"
    finally:
        engine.stop()
