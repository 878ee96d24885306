"""The speculative bench's `bench.verify_graph_vs_eager` on CPU: score graphs recorded by gates.shared.replay's
rerun recorder (each replay runs the static step again over the graph's static buffers), so the harness's
bookkeeping (what it snapshots, restores and refills between the eager run, the replay and the control) is
tested without a GPU. The H200 run of 2026-12-01 failed this row at batch 1 and 16 with the metric half the
control: the harness's eager score + commit advanced the runner's cached-token counts, so the replay scored
one position later than the eager step (same KDA records, MLA context one key longer)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from k3verify.bench.spec_parity import score_graph_parity
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.gates.shared.replay import RerunStep, rerun_recorder
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner
from k3verify.serving.spec.scorer import SpecScorer

BUCKETS = (1, 3)


@pytest.fixture(scope="module")
def scorer() -> SpecScorer:
    cfg = get_preset("kl-tiny")
    model = ServingModel(cfg, torch.bfloat16, "cpu").load(synthetic_tensors(cfg, seed=0))
    runner = ModelRunner(model, num_pages=48, page_size=8, num_slots=4, max_context=64)
    return SpecScorer(runner, num_draft=4, max_rows=max(BUCKETS), fused=True)


def _prompts(rows: int) -> torch.Tensor:
    return torch.randint(1, 1000, (rows, 19), generator=torch.Generator().manual_seed(rows))


@pytest.mark.parametrize("rows", BUCKETS)
def test_score_graph_parity_is_bit_exact_and_its_control_fails(scorer: SpecScorer, rows: int) -> None:
    graphs = scorer.make_graphs(48, BUCKETS, recorder=rerun_recorder)
    result: dict[str, Any] = score_graph_parity(scorer, graphs, _prompts(rows))
    assert result["id"] == f"bench.verify_graph_vs_eager.b{rows}"
    assert result["status"] == "pass" and result["metric"] == 0, result
    assert result["control_metric"] > 0, result
    graph = graphs._graphs[graphs.bucket_for(rows)][0]
    assert isinstance(graph, RerunStep) and graph.replays == 3, "eager vs replay, the other pack, the control"
    assert scorer.runner.active_ids == [], "the harness releases its sequences"
