"""The engine's step log and the served bench's breakdown of it (bench/served.step_breakdown): which steps carried
prompt tokens, how many, and the launch-to-launch interval of decode-only steps and of steps with prefill."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from k3verify.bench.served import step_breakdown
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.runner import build_runner
from k3verify.serving.sampler import SamplingParams
from k3verify.tokenizer import default_tokenizer


def test_breakdown_of_a_known_log() -> None:
    log = [(0.000, 0, 256), (0.030, 2, 0), (0.032, 2, 0), (0.034, 2, 128), (0.054, 3, 0), (0.056, 3, 0)]
    out = step_breakdown(log)
    assert out["steps"] == 6 and out["prefill_steps"] == 2 and out["prefill_tokens_per_prefill_step"] == 192
    assert out["with_prefill_interval_ms_p50"] == pytest.approx(25.0)  # 30 ms and 20 ms
    assert out["decode_only_interval_ms_p50"] == pytest.approx(2.0)
    assert out["prefill_share_of_time"] == pytest.approx(50 / 56)
    assert step_breakdown([]) == {"steps": 0, "prefill_steps": 0}


def test_engine_logs_each_step_only_while_recording() -> None:
    cfg = get_preset("k3-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, page_size=8, num_slots=4,
                          max_context=128)
    engine = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size).start()
    prompts = [list(range(5, 25)), list(range(30, 41))]
    try:
        assert engine.step_log is None
        engine.record_steps(True)
        done = [threading.Event() for _ in prompts]

        def sink(i: int) -> Callable[[EngineEvent], None]:
            def put(ev: EngineEvent) -> None:
                if ev.finished:
                    done[i].set()
            return put

        engine.submit(prompts[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), sink(0))
        assert done[0].wait(60)
        engine.submit(prompts[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), sink(1))
        assert done[1].wait(60)
        log = list(engine.step_log or ())
        engine.record_steps(False)
        assert engine.step_log is None
    finally:
        engine.stop()
    assert [p for _, _, p in log if p] == [len(prompts[0]), len(prompts[1])], log  # one prefill step each
    assert sum(d for _, d, _ in log) == 2 * 3, log  # 3 decode steps each after the prefill's token
    assert all(b[0] >= a[0] for a, b in zip(log[:-1], log[1:], strict=True))
    assert step_breakdown(log)["prefill_steps"] == 2


def test_arrival_bursts_of_a_known_log() -> None:
    """Two bursts (4 and 2 arrivals) 1 s apart: sizes, spreads (30 and 2 ms), widest inner gaps (20 and 2 ms)."""
    from k3verify.bench.served import arrival_bursts

    out = arrival_bursts([0.0, 0.005, 0.010, 0.030, 1.0, 1.002])
    assert out["bursts"] == 2 and out["size_p50"] == 3.0
    assert out["spread_ms_p50"] == pytest.approx(16.0) and out["widest_gap_ms_p50"] == pytest.approx(11.0)
    assert arrival_bursts([]) == {"bursts": 0}
