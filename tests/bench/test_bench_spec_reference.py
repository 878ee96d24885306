"""The controlled drafter's reference iteration (bench/spec_ref.py) on CPU, kl-tiny in bf16.

On CPU the speculative path reproduces plain decode token for token (checked below), so the H200's bf16 flip
is built by hand: the starting reference takes a different token at position D and then the model's own greedy
continuation from there, i.e. a self-consistent trajectory the speculative path does not follow, as the plain
continuation was on the H200 after the first score-vs-decode argmax flip."""

from __future__ import annotations

import pytest
import torch

from k3verify.bench.spec_ref import continuation_match, converge_reference, expected_acceptance
from k3verify.bench.speeds import generate_ours
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.model import ServingModel
from k3verify.serving.runner import ModelRunner
from k3verify.serving.spec.drafter import ControlledDrafter
from k3verify.serving.spec.offline import SpecRun, generate_speculative
from k3verify.serving.spec.policy import SpecPolicy
from k3verify.serving.spec.scorer import SpecScorer

B, PROMPT, NEW, D, K = 2, 8, 32, 6, 4
Refs = dict[int, list[int]]


@pytest.fixture(scope="module")
def setup() -> tuple[SpecScorer, list[list[int]], Refs, Refs]:
    """(scorer, prompts, plain references, flipped references)."""
    cfg = get_preset("kl-tiny")
    model = ServingModel(cfg, torch.bfloat16, "cpu").load(synthetic_tensors(cfg, seed=0))
    runner = ModelRunner(model, num_pages=32, page_size=8, num_slots=B + 1, max_context=PROMPT + NEW + 8)
    scorer = SpecScorer(runner, num_draft=K, max_rows=B, fused=False)
    ids = torch.randint(1, 1000, (B, PROMPT), generator=torch.Generator().manual_seed(3))
    plain = generate_ours(runner, None, ids, NEW).tolist()
    prompts = ids.tolist()
    forced = torch.tensor([p + o[:D] + [(o[D] + 1) % cfg.vocab_size] for p, o in zip(prompts, plain, strict=True)])
    tail = generate_ours(runner, None, forced, NEW - D - 1).tolist()
    flipped = {i: forced[i].tolist() + tail[i] for i in range(B)}
    return scorer, prompts, {i: p + o for i, (p, o) in enumerate(zip(prompts, plain, strict=True))}, flipped


def _run(scorer: SpecScorer, prompts: list[list[int]], refs: Refs, corrupt: float) -> SpecRun:
    drafter = ControlledDrafter(K, refs, corrupt, scorer.runner.model.cfg.vocab_size, seed=0)
    return generate_speculative(scorer, drafter, prompts, NEW, policy=SpecPolicy(min_mean_accepted=0.0))


def test_cpu_speculative_equals_plain_and_the_flipped_reference_is_a_different_trajectory(setup: tuple) -> None:
    """The premise of the constructed case: CPU bf16 does not flip, and the hand-made flip changes the tail."""
    scorer, prompts, plain, flipped = setup
    assert continuation_match(_run(scorer, prompts, plain, 0.0).tokens, prompts, plain) == 1.0
    tails = [(plain[i][PROMPT + D:], flipped[i][PROMPT + D:]) for i in range(B)]
    assert all(sum(a != b for a, b in zip(p, f, strict=True)) > (NEW - D) // 2 for p, f in tails), tails


@pytest.mark.parametrize("accept", [1.0, 0.8])
def test_converged_reference_reproduces_itself_and_beats_the_flipped_one(setup: tuple, accept: float) -> None:
    """From the flipped start the iteration converges on the speculative path's own continuation (here plain's),
    which the run then reproduces exactly, with every draft accepted at corrupt 0 and the measured acceptance
    above what the flipped reference gave."""
    scorer, prompts, plain, flipped = setup
    stale = _run(scorer, prompts, flipped, 1.0 - accept)
    ref = converge_reference(lambda refs: _run(scorer, prompts, refs, 1.0 - accept).tokens, prompts, flipped, NEW)
    assert ref.converged and 2 <= ref.iterations <= NEW, ref.iterations
    assert ref.references == plain
    run = _run(scorer, prompts, ref.references, 1.0 - accept)
    assert continuation_match(run.tokens, prompts, ref.references) == 1.0
    assert continuation_match(stale.tokens, prompts, flipped) < 1.0
    assert run.acceptance > stale.acceptance, (run.acceptance, stale.acceptance)
    if accept == 1.0:
        assert run.acceptance == 1.0
    else:
        assert abs(run.acceptance - expected_acceptance(accept, K)) < 0.2, run.acceptance


def test_a_reference_that_is_no_fixed_point_is_reported_not_converged(setup: tuple) -> None:
    """Control: with the cap at 0 or 1 iterations the flipped start is never confirmed; the plain one (a fixed
    point on CPU) is confirmed by the first run, so the cap-1 verdict tells the two apart."""
    scorer, prompts, plain, flipped = setup

    def run_with(refs: Refs) -> list[list[int]]:
        return _run(scorer, prompts, refs, 0.0).tokens

    for cap in (0, 1):
        ref = converge_reference(run_with, prompts, flipped, cap)
        assert not ref.converged and ref.iterations == cap
    assert converge_reference(run_with, prompts, flipped, 0).references == flipped
    confirmed = converge_reference(run_with, prompts, plain, 1)
    assert confirmed.converged and confirmed.iterations == 1 and confirmed.references == plain


def test_an_oscillating_run_stops_at_the_cap() -> None:
    """A run that never reproduces its reference (each run answers the other of two continuations) is cut at the
    cap and reported not converged, whatever the cap."""
    prompts = [[5, 6]]

    def run_with(refs: Refs) -> list[list[int]]:
        return [[1, 1]] if refs[0][2:] == [2, 2] else [[2, 2]]

    for cap in (2, 7):
        ref = converge_reference(run_with, prompts, {0: [5, 6, 1, 1]}, cap)
        assert not ref.converged and ref.iterations == cap


def test_expected_acceptance_is_the_mean_accepted_prefix_over_k() -> None:
    assert expected_acceptance(0.8, 4) == pytest.approx((0.8 + 0.64 + 0.512 + 0.4096) / 4)
    assert expected_acceptance(0.0, 4) == 0.0 and expected_acceptance(1.0, 4) == 1.0
    with pytest.raises(ValueError, match="1.5"):
        expected_acceptance(1.5, 4)
