"""The rounding near-tie excuse never turns a fault into a pass: faults injected into an "endpoint" that is the
project's own k3-tp4 oracle at fp32 computing w4a8-q8act (tools/excuse_sweep.py), judged by
endpoint.logprobs.topk with and without the excuse. The rule: no FAIL becomes a PASS through an excuse unless its
distance after excusing is within 1.5x the fault-free run's, measured in the same run on the same prompts. The
whole sweep (5 prompt sets, 3 sizes on 3 tensors) runs by hand: `python -m tools.excuse_sweep`, its table in
docs/results/."""

from __future__ import annotations

import pytest

from k3verify.target import resolve_target
from tools.excuse_sweep import PASSED, ROUTED, Judge, Outcome, Variant, _scale, run, sweep, variants

PRECISION = "w4a8-q8act"


@pytest.fixture(scope="module")
def judge() -> Judge:
    return Judge(resolve_target("k3-tp4"), PRECISION)


def _broken(outcomes: list[Outcome]) -> tuple[list[tuple], list[tuple]]:
    """(faults that flipped to a pass through an excuse beyond 1.5x the fault-free run's distance, correct
    variants that did not pass), each outcome's prompt set judged against that set's fault-free run."""
    clean = {o.seed: o for o in outcomes if o.variant == variants()[0]}
    assert clean and all(o.excused.status in PASSED for o in clean.values()), [o.excused.notes for o in clean.values()]
    flipped = [(o.variant.kind, o.variant.size, o.seed, o.excused.metric, clean[o.seed].excused.metric)
               for o in outcomes if o.flipped(clean[o.seed].excused.metric)]
    wrong = [(o.variant.kind, o.variant.size, o.seed, o.excused.status, o.excused.metric, o.excused.bar)
             for o in outcomes if o.variant.correct and o.excused.status not in PASSED]
    return flipped, wrong


def test_a_routed_expert_weight_scaled_by_1_0001_fails_with_the_excuse(judge: Judge) -> None:
    """One routed-expert weight x1.0001, the quick suite's prompt lengths drawn from torch.Generator().manual_seed(1),
    8 greedy tokens each: its greedy tokens equal the fault-free ones, so only the logprobs can tell, and a bar
    taken from the oracle's own code steps (0.10 here) or re-measured after forcing would let it pass."""
    scaled = Variant("scale routed expert w3", "x1.0001", weights=_scale(ROUTED, 1.0001))
    outcome, _ = run(judge, scaled, 1)
    result = outcome.excused
    assert result.status == "fail" and result.control is not None and result.control.status == "fail", result.notes
    assert result.bar is not None and result.metric is not None and result.metric > 10 * result.bar


def test_the_same_fault_on_prompt_set_2_is_not_carried_by_three_excused_roundings(judge: Judge) -> None:
    """On prompt set 2 the fault needs three roundings excused to come within the check's bar (1.37e-5 under
    3.64e-5), twice the fault-free run's distance after its one excused rounding: an excused pass is judged by 1.5x
    the oracle's own distance before forcing, and this one fails by it."""
    clean, got = run(judge, variants()[0], 2)
    scaled = Variant("scale routed expert w3", "x(1+0.0001)", weights=_scale(ROUTED, 1.0001))
    outcome, _ = run(judge, scaled, 2, got, both=True)
    flipped, wrong = _broken([clean, outcome])
    assert not flipped and not wrong, (flipped, wrong)
    result = outcome.excused
    assert result.status == "fail", result.notes
    assert result.metrics["excused_rounding_near_ties"] >= 1, result.notes  # the excuse was tried, and refused


def test_no_fault_passes_through_an_excuse_and_correct_variants_pass(judge: Judge) -> None:
    """One prompt set, the smallest fault of each kind: none becomes a pass through an excuse with its distance
    beyond 1.5x the fault-free run's, and the correct variants pass."""
    flipped, wrong = _broken(sweep(judge.target, PRECISION, [1], quick=True))
    assert not flipped, flipped
    assert not wrong, wrong
