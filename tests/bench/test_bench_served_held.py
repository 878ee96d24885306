"""`bench --served`'s held waves on CPU: a wave's prompts are admitted by one engine step, in order, even after
earlier waves on the same server (the parity with the bench path's packed prefill rests on it)."""

from __future__ import annotations

import pytest
import torch

from k3verify.bench import served as sv
from k3verify.bench.timing import random_prompt
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.runner import build_runner
from k3verify.serving.scheduler import StepPlan


def test_each_held_wave_is_admitted_by_one_step_after_earlier_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waves of 1, 1 and 3 prompts on one stack: the wave of 3 must be prefilled as one pack of 3, in the prompts'
    order. (The server's prompt-token counter is cumulative: a hold released at this wave's token count alone
    let the first prompt of the wave through on its own.)"""
    cfg = get_preset("kl-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, page_size=8, num_slots=5,
                          max_context=64)
    bench_graphs = GraphDecoder(runner.model, 32, buckets=(1, 3), use_graphs=False)
    graphs = sv.engine_graphs(runner, bench_graphs, (1, 3))
    with sv.served_stack(runner, graphs, 3, 64) as stack:
        packs: list[list[list[int]]] = []
        schedule = stack.engine.scheduler.schedule

        def spy(admit: bool = True) -> StepPlan:
            plan = schedule(admit)
            if plan.prefill:
                packs.append([c.tokens for c in plan.prefill])
            return plan

        monkeypatch.setattr(stack.engine.scheduler, "schedule", spy)
        for n, seed in ((1, 1), (1, 2), (3, 3)):
            prompts = random_prompt(n, 8, cfg.vocab_size, seed, torch.device("cpu")).tolist()
            packs.clear()
            result = sv.held_wave(stack, prompts, 2)
            assert packs == [prompts], f"wave of {n}: prefill packs {[len(p) for p in packs]}"
            assert [len(sv.served_ids(r)) for r in result["requests"]] == [2] * n


def test_engine_decodes_each_served_concurrency_in_the_bench_paths_bucket() -> None:
    """A concurrency that is neither a power of two nor the largest (12 of 1,12,64) decodes in a bucket of its
    own size on both paths: the bench path's bucket 12, not the engine's power of two 16 (other GEMM shapes)."""
    cfg = get_preset("kl-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=8, page_size=8, num_slots=2,
                          max_context=32)
    bench_graphs = GraphDecoder(runner.model, 32, buckets=(1, 12, 64), use_graphs=False)
    graphs = sv.engine_graphs(runner, bench_graphs, (1, 12, 64))
    assert [graphs.bucket_for(c) for c in (1, 12, 64)] == [1, 12, 64]
    assert graphs.bucket_for(13) == 16 and graphs.buckets[-1] == 64
