"""The start-up warm-up (serving/warmup.py) runs its prefill ladder and leaves the runner as it found it."""

from __future__ import annotations

import pytest
import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.runner import build_runner
from k3verify.serving.warmup import prefill_ladder, warm_up


def test_ladder_covers_both_specialisations_of_each_size() -> None:
    ladder = prefill_ladder(64, pack=4)
    singles = sorted(p[0] for p in ladder if len(p) == 1)
    assert singles == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64]
    packs = [p for p in ladder if len(p) == 4]
    assert [sum(p) for p in packs] == [16, 17, 32, 33, 64] and all(min(p) >= 4 for p in packs)
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_ladder(0)


def test_warm_up_leaves_no_sequence_and_frees_everything() -> None:
    cfg = get_preset("k3-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, num_slots=8)
    graphs = GraphDecoder(runner.model, runner.max_context, buckets=(1, 2, 4), use_graphs=False)
    free_pages, free_slots = runner.kv_cache.num_free_pages, runner.state_pool.num_free
    report = warm_up(runner, graphs, max_step_tokens=128)
    assert runner.active_ids == []
    assert (runner.kv_cache.num_free_pages, runner.state_pool.num_free) == (free_pages, free_slots)
    assert report.buckets == ()  # eager decode: nothing to capture
    assert (128,) in report.prefills and (32, 32, 32, 32) in report.prefills
    # a sequence admitted after the warm-up decodes as on a fresh runner
    fresh = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, num_slots=8)
    prompt = list(range(5, 40))
    out = []
    for r in (runner, fresh):
        r.admit(7, 64)
        out.append(r.prefill([(7, prompt)]))
        out.append(r.decode([(7, 3)]))
        r.release(7)
    assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3])


def test_warm_up_refuses_a_busy_runner() -> None:
    cfg = get_preset("k3-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, num_slots=8)
    runner.admit(1, 16)
    with pytest.raises(RuntimeError, match=r"sequences \[1\] are admitted"):
        warm_up(runner, None, 64)


def test_warm_up_runs_the_ladder_through_the_prefill_graphs_static_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """With prefill graphs, every rung also runs their static step (fla's graph-mode kernels compile at start-up on
    CUDA), and the runner is left as it was found."""
    from k3verify.serving import prefill_graphs as pg

    cfg = get_preset("k3-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=torch.float32, num_pages=64, num_slots=8)
    graphs = pg.GraphPrefill(runner.model, max_tokens=128, max_seqs=16, use_graphs=False)
    runs: list[int] = []
    real = pg.static_prefill

    def counting(model: object, inputs: pg.PrefillInputs) -> torch.Tensor:
        runs.append(inputs.shape.num_tokens)
        return real(model, inputs)

    monkeypatch.setattr(pg, "static_prefill", counting)
    report = warm_up(runner, None, max_step_tokens=128, prefill_graphs=graphs)
    assert runner.active_ids == [] and runner.state_pool.num_free == 8
    bucketed = [p for p in report.prefills if pg.prefill_shape(p, max_tokens=128, max_seqs=16) is not None]
    assert len(runs) == len(bucketed) > 5
