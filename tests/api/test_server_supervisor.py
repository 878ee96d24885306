"""No single request can end the engine: per-request failure isolation, non-finite accounting and health states,
and the supervisor that restarts a dead loop with fresh caches (FakeRunner: fast, with real page bookkeeping)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from server_fakes import EOS, MODEL_VOCAB, ByteTokenizer, FakeRunner, _Slot

import k3verify.serving.step_loop as step_loop_mod
from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.health import EngineHealth, HealthPolicy
from k3verify.serving.sampler import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Collector:
    """Sinks for submitted requests; wait() until each got its final event."""

    def __init__(self) -> None:
        self.events: dict[int, list[EngineEvent]] = {}
        self.done: dict[int, threading.Event] = {}

    def submit(self, engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> int:
        key = len(self.events)
        self.events[key], self.done[key] = [], threading.Event()

        def sink(ev: EngineEvent) -> None:
            self.events[key].append(ev)
            if ev.finished:
                self.done[key].set()

        engine.submit(prompt, params, sink)
        return key

    def final(self, key: int, timeout: float = 10.0) -> EngineEvent:
        assert self.done[key].wait(timeout), f"request {key} never got a final event"
        return self.events[key][-1]


def make_engine(runner: FakeRunner, **kw: object) -> Engine:
    return Engine(runner, ByteTokenizer(), eos_token_ids=(EOS,), vocab_size=MODEL_VOCAB, **kw).start()  # type: ignore[arg-type]


class NaNRunner(FakeRunner):
    """Rows of sequences whose prompt starts with 0 are NaN; the others are the usual toy logits."""

    def logits_for(self, slot: _Slot) -> torch.Tensor:
        row = super().logits_for(slot)
        return torch.full_like(row, float("nan")) if slot.history[0] == 0 else row


def test_injected_fault_restarts_the_loop_with_fresh_caches() -> None:
    """The in-flight request fails with engine_unavailable naming the fault; the next one is served; counted."""
    runner = FakeRunner()
    engine, c = make_engine(runner), Collector()
    try:
        engine.inject_fault("chaos monkey")
        first = c.final(c.submit(engine, [1, 2, 3]))
        assert first.code == "engine_unavailable"
        assert "chaos monkey" in str(first.error) and "restarted" in str(first.error)
        second = c.final(c.submit(engine, [1, 2, 3]))
        assert second.finish_reason == "length" and second.completion_tokens == 6
        status = engine.status()
        assert engine.health() is None and status.state == "degraded" and status.restarts == 1
        assert "chaos monkey" in " ".join(status.reasons)
        engine.check_integrity()
        assert runner.slots == {} and runner.free_pages == runner.num_pages
    finally:
        engine.stop()


def test_restart_keeps_waiting_requests_queued() -> None:
    """A request still waiting for admission when the loop dies is served after the restart, not failed."""
    runner = FakeRunner(num_pages=6, page_size=16, max_slots=1)  # one sequence at a time
    engine, c = make_engine(runner), Collector()
    gate = threading.Event()
    real_decode = runner.decode

    def slow_decode(seqs: list[tuple[int, int]]) -> torch.Tensor:
        gate.wait(10)
        return real_decode(seqs)

    runner.decode = slow_decode  # type: ignore[method-assign]
    try:
        running = c.submit(engine, [1, 2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        waiting = c.submit(engine, [3, 4])
        engine.inject_fault("fault while one waits")
        gate.set()
        assert c.final(running).code == "engine_unavailable"
        assert c.final(waiting).finish_reason == "length"
    finally:
        engine.stop()


def test_supervisor_gives_up_past_max_restarts() -> None:
    """More than max_restarts faults within the window leave the loop dead: /health's reason says it gave up."""
    engine, c = make_engine(FakeRunner(), health_policy=HealthPolicy(max_restarts=2)), Collector()
    try:
        for i in range(3):
            engine.inject_fault(f"fault {i}")
            ev = c.final(c.submit(engine, [5]))
            assert ev.code == "engine_unavailable"
        assert engine.health() is not None and "gave up after 2 restart" in engine.health()  # type: ignore[operator]
        assert engine.status().state == "unhealthy"
    finally:
        engine.stop()


def test_nonfinite_logits_fail_that_request_and_count() -> None:
    """A NaN row fails only its request (code nonfinite_logits); its batch neighbour completes; health degrades."""
    engine, c = make_engine(NaNRunner()), Collector()
    try:
        bad, good = c.submit(engine, [0, 9]), c.submit(engine, [1, 9])
        assert c.final(bad).code == "nonfinite_logits" and "non-finite" in str(c.final(bad).error)
        assert c.final(good).finish_reason == "length"
        status = engine.status()
        assert status.state == "degraded" and status.nonfinite_failures == 1 and engine.health() is None
    finally:
        engine.stop()


def test_nonfinite_past_threshold_is_unhealthy_but_still_serving() -> None:
    """max_nonfinite failures within the window make the status unhealthy; finite requests are still served."""
    engine, c = make_engine(NaNRunner(), health_policy=HealthPolicy(max_nonfinite=3)), Collector()
    try:
        for _ in range(3):
            c.final(c.submit(engine, [0, 1]))
        status = engine.status()
        assert status.state == "unhealthy" and "threshold 3" in " ".join(status.reasons)
        assert c.final(c.submit(engine, [2, 2])).finish_reason == "length"
    finally:
        engine.stop()


def test_sampling_failure_fails_only_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """If batched sampling raises, rows are drawn one by one; only the row that raises loses its request."""
    real = step_loop_mod.sample_tokens

    def fragile(logits: torch.Tensor, params: list[SamplingParams], seeds: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        if any(p.temperature == 0.5 for p in params):
            raise RuntimeError("sampler broke on this row")
        return real(logits, params, seeds, positions)

    monkeypatch.setattr(step_loop_mod, "sample_tokens", fragile)
    runner = FakeRunner()
    engine, c = make_engine(runner), Collector()
    try:
        gate = threading.Event()  # holds the engine thread so both requests join one prefill batch
        threading.Thread(target=engine.call, args=(lambda: gate.wait(10),), daemon=True).start()
        victim = c.submit(engine, [1, 2], SamplingParams(max_tokens=4, temperature=0.5, ignore_eos=True))
        bystander = c.submit(engine, [1, 2], SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True))
        gate.set()
        assert c.final(victim).code == "sampling_failed" and "sampler broke" in str(c.final(victim).error)
        assert c.final(bystander).finish_reason == "length"
        assert runner.prefill_calls[0] == 2, "the two requests never shared a batch: proves nothing"
        assert engine.status().restarts == 0 and engine.health() is None
    finally:
        engine.stop()


def test_detokenizer_failure_fails_only_its_request() -> None:
    """A tokenizer that raises on one token fails the request that drew it; the engine keeps serving."""

    class Brittle(ByteTokenizer):
        def token_bytes(self, token_id: int) -> bytes:
            if token_id == ord("q"):
                raise UnicodeError("cannot render q")
            return super().token_bytes(token_id)

    class Scripted(FakeRunner):
        def logits_for(self, slot: _Slot) -> torch.Tensor:
            row = torch.full((MODEL_VOCAB,), -5.0)
            row[ord("q") if slot.history[0] == 0 else ord("a")] = 5.0
            return row

    engine = Engine(Scripted(), Brittle(), eos_token_ids=(EOS,), vocab_size=MODEL_VOCAB).start()
    c = Collector()
    try:
        bad, good = c.submit(engine, [0, 1]), c.submit(engine, [1, 1])
        assert c.final(bad).code == "request_failed" and "cannot render q" in str(c.final(bad).error)
        assert c.final(good).finish_reason == "length" and "".join(e.text for e in c.events[good]) == "aaaaaa"
        assert engine.status().state == "ok"
    finally:
        engine.stop()


def test_health_window_forgets_old_trouble() -> None:
    """Restarts and non-finite failures older than the window no longer degrade the status."""
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    health = EngineHealth(HealthPolicy(max_nonfinite=2, max_restarts=1, window_s=10.0), clock)
    assert health.record_restart("r1") and not health.record_restart("r2")  # 2 > max_restarts within 10 s
    health.record_nonfinite()
    assert health.status(None).state == "degraded"
    health.record_nonfinite()
    assert health.status(None).state == "unhealthy"
    now[0] = 11.0
    assert health.status(None).state == "ok" and health.status(None).nonfinite_failures == 2
    assert health.record_restart("r3")
    assert health.status("loop dead").state == "unhealthy"
