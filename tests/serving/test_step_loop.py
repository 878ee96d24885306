"""The engine's device step on CPU: slot-gathered decode inputs, non-finite flags,
the overlapped engine loop against offline greedy decoding, and the staging copies."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.engine import GIL_SWITCH_S, Engine, EngineEvent
from k3verify.serving.graphs import GraphDecoder, engine_buckets
from k3verify.serving.runner import ModelRunner, build_runner, generate_greedy
from k3verify.serving.sampler import SamplingParams, nonfinite_mask
from k3verify.serving.staging import HostStaging, PinnedReadback
from k3verify.serving.step_loop import nonfinite_rows

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [100, 200, 300, 400, 500, 600, 700], [1, 2, 3, 4, 5, 6, 7] * 12]


def _runner(preset: str = "k3-tiny", num_slots: int = 6) -> ModelRunner:
    cfg = get_preset(preset)
    return build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, page_size=8,
                        num_slots=num_slots, max_context=128)


@pytest.mark.parametrize("use_graph_inputs", [False, True], ids=["eager", "static_step"])
def test_decode_next_equals_decode_with_host_tokens(use_graph_inputs: bool) -> None:
    """Tokens stored by slot on the device and gathered there feed the same step as host token lists."""
    runner = _runner()
    graphs = GraphDecoder(runner.model, 128, buckets=(4,), use_graphs=False) if use_graph_inputs else None
    ids = list(range(len(PROMPTS)))
    for sid, p in zip(ids, PROMPTS, strict=True):
        runner.admit(sid, len(p) + 4)
    toks = runner.prefill(list(zip(ids, PROMPTS, strict=True))).argmax(-1)
    pool, kv = runner.state_pool.tensors(), runner.kv_cache.data
    snap = ({k: v.clone() for k, v in pool.items()}, kv.clone())
    ref = runner.decode(list(zip(ids, toks.tolist(), strict=True)), graphs)
    for k, v in snap[0].items():
        pool[k].copy_(v)
    kv.copy_(snap[1])
    for sid in ids:
        runner._get(sid).cached -= 1
    order = [2, 0, 3, 1]  # another row order: the gather must follow the slots, not the row index
    runner.set_next_tokens(order, toks[order])
    cand = runner.decode_next(order, graphs)
    assert torch.equal(cand, ref[order])


def test_nonfinite_rows_flags_nan_posinf_and_empty_rows() -> None:
    logits = torch.zeros(5, 8)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    logits[4, :7] = float("-inf")  # one finite entry left: a masked row, not a broken one
    assert nonfinite_rows(logits).tolist() == [False, True, True, True, False]
    assert torch.equal(nonfinite_rows(logits), nonfinite_mask(logits)), "one reduction, the sampler's semantics"


def test_staging_and_readback_round_trip_on_cpu() -> None:
    dev = torch.device("cpu")
    dst = torch.empty(2, 3, dtype=torch.long)
    HostStaging(dev, depth=2, capacity=1).copy_into(dst, [1, 2, 3, 4, 5, 6])
    assert dst.tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match="staging 2 int64 values"):
        HostStaging(dev).copy_into(dst, [1, 2])
    host, event = PinnedReadback(dev).start(torch.tensor([3.5, -1.0]))
    assert event is None and host.tolist() == [3.5, -1.0]


def test_engine_buckets_cover_every_batch() -> None:
    assert engine_buckets(1) == (1,) and engine_buckets(8) == (1, 2, 4, 8) and engine_buckets(24)[-2:] == (16, 24)


def _engine_tokens(runner: ModelRunner, prompts: list[list[int]], max_new: int, **kw: Any) -> list[list[int]]:
    from k3verify.tokenizer import default_tokenizer

    cfg = runner.model.cfg
    engine = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                    **kw).start()
    out: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i: int) -> Callable[[EngineEvent], None]:
        def put(ev: EngineEvent) -> None:
            out[i] += ev.token_ids
            if ev.finished:
                assert ev.error is None, ev.error
                done[i].set()
        return put

    try:
        for i, p in enumerate(prompts):
            engine.submit(p, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True), sink(i))
        assert all(d.wait(60) for d in done), "a request never finished"
        engine.check_integrity()
    finally:
        engine.stop()
    return out


def test_overlapped_chunked_engine_equals_offline_greedy() -> None:
    """The engine (step n+1 launched before step n is read, prompts chunked at 16 tokens per step, decode
    through the static graph step) returns generate_greedy's tokens; the long prompt really was chunked."""
    runner = _runner()
    want = generate_greedy(runner, PROMPTS, 6)
    calls: list[int] = []
    prefill = runner.prefill

    def counting(seqs: list[tuple[int, list[int]]]) -> torch.Tensor:
        calls.append(max(len(t) for _, t in seqs))
        return prefill(seqs)

    setattr(runner, "prefill", counting)  # noqa: B010 (an instance attribute shadows the method)
    graphs = GraphDecoder(runner.model, runner.max_context, buckets=engine_buckets(6), use_graphs=False)
    got = _engine_tokens(runner, PROMPTS, 6, max_step_tokens=16, graphs=graphs)
    assert got == want
    assert max(calls) <= 16 and len(calls) >= len(PROMPTS[-1]) // 16
    assert runner.active_ids == []


@pytest.mark.gpu
def test_cuda_decode_launch_never_waits_for_the_gpu() -> None:
    """On CUDA an engine decode step (graph replay, sampling, token store, readback) issues no synchronising
    call: torch's sync debug mode raises on any. (Token parity on CUDA: serving.engine.step_loop_* checks.)"""
    from k3verify.serving.scheduler import Scheduler
    from k3verify.serving.step_loop import StepLauncher

    cfg = get_preset("k3-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.bfloat16, device="cuda", num_pages=64,
                          page_size=16, num_slots=4, max_context=128)
    graphs = GraphDecoder(runner.model, runner.max_context, buckets=engine_buckets(4))
    for bucket in graphs.buckets:
        graphs.capture(bucket)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    from k3verify.serving.request import Request

    reqs = {i: Request(seq_id=i, prompt_ids=p, max_new_tokens=8, params=params, stop_ids=frozenset(), seed=0,
                       decoder=None, sink=lambda e: None, arrival=0.0) for i, p in enumerate(PROMPTS)}
    sched = Scheduler(runner, max_step_tokens=512)
    for r in reqs.values():
        sched.add(r)
    launcher = StepLauncher(runner, graphs)
    flight = launcher.launch(sched.schedule(), reqs)  # the prefill step may synchronise (packing metadata)
    torch.cuda.synchronize()
    for _ in range(3):
        torch.cuda.set_sync_debug_mode("error")
        try:
            nxt = launcher.launch(sched.schedule(), reqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert flight is not None
        launcher.collect(flight)
        flight = nxt
    for sid in reqs:
        sched.finish(sid)


def test_engine_start_lowers_the_gil_switch_interval_and_never_raises_it() -> None:
    """The engine thread must not wait CPython's default 5 ms for the HTTP thread to drop the GIL."""
    from k3verify.tokenizer import default_tokenizer

    before = sys.getswitchinterval()
    runner = _runner()
    cfg = runner.model.cfg
    try:
        sys.setswitchinterval(0.005)
        eng = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                     max_step_tokens=64).start()
        eng.stop()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
        sys.setswitchinterval(0.0001)
        eng = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                     max_step_tokens=64).start()
        eng.stop()
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)
