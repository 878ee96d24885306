"""Unit tests below HTTP: stop-string holding, FIFO scheduling, engine stop/fault logic (the sampler:
tests/serving/test_serving_sampler.py)."""

from __future__ import annotations

import pytest
import torch
from server_fakes import EOS, IM_END, MODEL_VOCAB, ByteTokenizer, FakeRunner, _Slot

from k3verify.gates.shared.engine_run import collect_events
from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.request import find_stop, partial_stop_len
from k3verify.serving.sampler import SamplingParams
from k3verify.serving.scheduler import ScheduledSeq, Scheduler, StepPlan


class ScriptedRunner(FakeRunner):
    """Emits `script[i]` as the i-th generated token (one-hot logits); NaN logits where the script says None."""

    def __init__(self, script: list[int | None], **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.script = script

    def logits_for(self, slot: _Slot) -> torch.Tensor:
        step = len(slot.history) - slot.prompt_len
        token = self.script[min(step, len(self.script) - 1)]
        if token is None:
            return torch.full((MODEL_VOCAB,), float("nan"))
        row = torch.full((MODEL_VOCAB,), -5.0)
        row[token] = 5.0
        return row


def run_engine(runner: FakeRunner, requests: list[tuple[list[int], SamplingParams]], **kw: object
               ) -> list[list[EngineEvent]]:
    """Submit all requests to a real Engine thread and collect each one's events until it finishes."""
    engine = Engine(runner, ByteTokenizer(), eos_token_ids=(EOS, IM_END), vocab_size=MODEL_VOCAB, **kw).start()
    try:
        events = collect_events(engine, requests, timeout_s=10)
        if engine.health() is None:
            engine.check_integrity()
    finally:
        engine.stop()
    return events


def text_of(events: list[EngineEvent]) -> str:
    return "".join(e.text for e in events)


def test_find_stop_and_partial_hold() -> None:
    """The earliest stop wins; a tail that could still become a stop is held back, nothing else is."""
    assert find_stop("abcENDxEN", 0, ["END", "xE"]) == 3
    assert find_stop("abcENDx", 4, ["END"]) is None
    assert partial_stop_len("hello EN", 0, ["END"]) == 2
    assert partial_stop_len("hello E", 0, ["END", "Ex"]) == 1
    assert partial_stop_len("hello", 0, ["END"]) == 0
    assert partial_stop_len("xEN", 1, ["END"]) == 2
    assert partial_stop_len("xEN", 2, ["END"]) == 0  # "E" was already sent: only "N" is unsent


def _admitted(plan: StepPlan) -> list[int]:
    return [c.seq.seq_id for c in plan.prefill if c.start == 0]


def test_scheduler_is_fifo_without_overtaking() -> None:
    """A head that does not fit blocks smaller later requests (no starvation of long prompts)."""
    runner = FakeRunner(num_pages=10, page_size=16)
    sched = Scheduler(runner, max_step_tokens=10_000)
    sched.add(ScheduledSeq(1, [1] * 100, 40))  # 9 pages
    assert _admitted(sched.schedule()) == [1]
    sched.add(ScheduledSeq(2, [1] * 100, 40))  # does not fit now
    sched.add(ScheduledSeq(3, [1] * 4, 4))  # would fit, but must not overtake 2
    plan = sched.schedule()
    assert _admitted(plan) == [] and [s.seq_id for s in plan.decode] == [1] and sched.num_waiting == 2
    sched.finish(1)
    assert _admitted(sched.schedule()) == [2, 3]
    runner.check_integrity()


def test_scheduler_chunks_prompts_within_the_step_budget() -> None:
    """Decode rows take one token each; prompts fill the rest in FIFO chunks cut on the 64-token grid."""
    sched = Scheduler(FakeRunner(num_pages=200), max_step_tokens=100)
    sched.add(ScheduledSeq(0, [1] * 30, 4))
    sched.add(ScheduledSeq(1, [1] * 150, 4))
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [(0, 0, 30), (1, 0, 64)]
    assert plan.decode == [] and not plan.prefill[1].is_last and plan.prefill[0].is_last
    sched.add(ScheduledSeq(2, [1] * 10, 4))
    plan = sched.schedule()  # seq 0 decodes; seq 1 continues (99 left: 86 finish it); 2 gets the remaining 13
    assert [s.seq_id for s in plan.decode] == [0]
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefill] == [(1, 64, 150), (2, 0, 10)]
    assert plan.num_tokens == 1 + 86 + 10
    plan = sched.schedule()
    assert [s.seq_id for s in plan.decode] == [0, 1, 2] and plan.prefill == []


def test_scheduler_stops_launching_at_max_tokens() -> None:
    """A sequence is decoded until max_new_tokens tokens were launched (the prefill's counts as the first)."""
    sched = Scheduler(FakeRunner(num_pages=20), max_step_tokens=64)
    seq = ScheduledSeq(0, [1, 2, 3], 3)
    sched.add(seq)
    plans = [sched.schedule() for _ in range(4)]
    assert [len(p.prefill) for p in plans] == [1, 0, 0, 0]
    assert [len(p.decode) for p in plans] == [0, 1, 1, 0]
    assert seq.num_launched == 3 and not seq.can_decode


def test_stop_string_spanning_tokens_never_leaks() -> None:
    """With stop "END", text streamed before the match never contains a piece of it; a false start is released."""
    script = [ord(c) for c in "abENxyEND!"]
    events = run_engine(ScriptedRunner(script), [([1, 2], SamplingParams(max_tokens=20, temperature=0, stop=("END",)))])
    [ev] = events
    assert text_of(ev) == "abENxy"
    assert "E" not in "".join(e.text for e in ev[:2]) and ev[-1].finish_reason == "stop"
    assert [e.text for e in ev[:4]] == ["a", "b", "", ""]  # "E", "EN" held back until "x" rules the stop out


@pytest.mark.parametrize("eos", [EOS, IM_END], ids=["config_eos", "generation_eos"])
def test_both_eos_ids_stop_unless_ignored(eos: int) -> None:
    """Config eos and generation eos both end generation (no eos text); ignore_eos runs to max_tokens."""
    script = [ord("h"), ord("i"), eos, ord("z")]
    stop, cont = run_engine(ScriptedRunner(script), [
        ([5], SamplingParams(max_tokens=6, temperature=0)),
        ([5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))])
    assert text_of(stop) == "hi" and stop[-1].finish_reason == "stop" and stop[-1].completion_tokens == 3
    assert cont[-1].finish_reason == "length" and cont[-1].completion_tokens == 6 and text_of(cont) == "hizzz"


def test_nonfinite_logits_fail_one_request_not_the_engine() -> None:
    """NaN logits end that request with an error; the engine stays healthy for the next request."""
    runner = ScriptedRunner([ord("a"), None])
    [bad] = run_engine(runner, [([7], SamplingParams(max_tokens=5, temperature=0))])
    assert bad[-1].error is not None and "non-finite" in bad[-1].error
    runner.script = [ord("a"), ord("b")]
    [good] = run_engine(runner, [([7], SamplingParams(max_tokens=3, temperature=0))])
    assert text_of(good) == "abb" and good[-1].finish_reason == "length"


def test_debug_mode_integrity_violation_kills_loop_loudly() -> None:
    """debug=True checks the caches after every step: a corrupted page count fails every pending request."""
    runner = FakeRunner()
    runner.free_pages -= 1  # a leaked page
    [events] = run_engine(runner, [([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))], debug=True)
    assert events[-1].error is not None and "page accounting broken" in events[-1].error


def test_check_integrity_on_demand_raises() -> None:
    """engine.check_integrity() runs the runner's check on the engine thread and raises what it raises."""
    runner = FakeRunner()
    engine = Engine(runner, ByteTokenizer(), eos_token_ids=(EOS,), vocab_size=MODEL_VOCAB).start()
    try:
        engine.check_integrity()
        runner.free_pages += 2
        with pytest.raises(RuntimeError, match="page accounting broken"):
            engine.check_integrity()
        assert engine.health() is None
    finally:
        engine.stop()
