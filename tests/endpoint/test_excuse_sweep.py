"""The rounding near-tie excuse never turns a fault into a pass: faults injected into an "endpoint" that is the
project's own k3-tp4 oracle at fp32 computing w4a8-q8act (tools/excuse_sweep.py), judged by
endpoint.logprobs.topk with and without the excuse. The whole sweep (5 prompt sets, 3 sizes on 3 tensors) runs by
hand: `python -m tools.excuse_sweep`, its table in docs/results/cpu-2026-12-06/."""

from __future__ import annotations

import pytest

from k3verify.target import resolve_target
from tools.excuse_sweep import ROUTED, Judge, Variant, _scale, run, sweep

PRECISION = "w4a8-q8act"


@pytest.fixture(scope="module")
def judge() -> Judge:
    return Judge(resolve_target("k3-tp4"), PRECISION)


def test_a_routed_expert_weight_scaled_by_1_0001_fails_with_the_excuse(judge: Judge) -> None:
    """One routed-expert weight x1.0001, the quick suite's prompt lengths drawn from torch.Generator().manual_seed(1),
    8 greedy tokens each: its greedy tokens equal the fault-free ones, so only the logprobs can tell, and a bar
    taken from the oracle's own code steps (0.10 here) or re-measured after forcing would let it pass."""
    scaled = Variant("scale routed expert w3", "x1.0001", weights=_scale(ROUTED, 1.0001))
    outcome, _ = run(judge, scaled, 1)
    result = outcome.excused
    assert result.status == "fail" and result.control is not None and result.control.status == "fail", result.notes
    assert result.bar is not None and result.metric is not None and result.metric > 10 * result.bar


def test_no_fault_passes_through_an_excuse_and_correct_variants_pass(judge: Judge) -> None:
    """One prompt set, the smallest fault of each kind: none becomes a pass through an excuse (beyond 1.5x the
    fault-free run's distance, by a fault that alone moves the rows past the bar), and the correct variants pass."""
    outcomes = sweep(judge.target, PRECISION, [1], quick=True)
    clean = outcomes[0]
    assert clean.variant.correct and clean.excused.status in ("pass", "excused"), clean.excused.notes
    hidden = [(o.variant.kind, o.variant.size, o.excused.metric, o.own) for o in outcomes
              if o.hidden(clean.excused.metric)]
    assert not hidden, hidden
    wrong = [(o.variant.kind, o.variant.size, o.excused.status, o.excused.metric, o.excused.bar)
             for o in outcomes if o.variant.correct and o.excused.status not in ("pass", "excused")]
    assert not wrong, wrong
