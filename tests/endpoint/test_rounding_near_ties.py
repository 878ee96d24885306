"""Rounding near-ties of an emulated precision (w4a8-q8act): the ledger records and forces Q8_0 codes by site, and
the endpoint checks excuse a rounding a correct implementation may take either way, never one that is not a tie.

The "endpoint" here is the oracle itself at the declared precision with one rounding taken the other way: at a
near-tie it is a correct w4a8-q8act implementation, far from a boundary it is a one-code fault."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3verify.gates.checks.endpoint.tokens import EXCUSED_BAR_FACTOR, Answer, Rows, _measured_trial
from k3verify.gates.core.check import REGISTRY, CheckContext, Result, Status, Trial
from k3verify.gates.core.evaluate import evaluate_trial
from k3verify.gates.shared import endpoint_oracle as eo
from k3verify.gates.shared.endpoint_oracle import MAX_FORCED, Scores, _oracle_run, rel_rms, resolve_roundings, score
from k3verify.oracle import functional as Fn
from k3verify.oracle import rounding
from k3verify.oracle.precision import get_precision
from k3verify.oracle.rounding import DOWN, INPUT, SCALE, Ledger, Site, near_ties
from k3verify.target import resolve_target

FACTOR = 5.1  # the fp32 logprob checks' bar factor (gates/checks/endpoint/tokens.py BAR_FACTOR)


def test_forced_code_changes_exactly_that_value_and_is_recorded() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    plain = Fn.q8_0_round(x)
    assert torch.equal(rounding.q8_0_round(x, 1, INPUT, -1, [4, 7, 9]), plain)  # no ledger: plain rounding
    scaled, q, _ = Fn.q8_0_codes(x)
    site = Site(1, 7, INPUT, -1, 40)
    code = int(q.reshape(3, 64)[1, 40])
    ledger = Ledger({site: code + 1, Site(1, 8, INPUT, -1, 0): 0, Site(2, 7, INPUT, -1, 40): 0})
    with rounding.recording(ledger):
        forced = rounding.q8_0_round(x, 1, INPUT, -1, [4, 7, 9])
    changed = (forced != plain).nonzero().tolist()
    assert changed == [[1, 40]] and ledger.used == {site}  # other tokens and layers untouched
    assert sorted(ledger.rows) == sorted((1, t, stage, -1) for t in (4, 7, 9) for stage in (INPUT, INPUT + SCALE))
    assert torch.equal(ledger.rows[(1, 7, INPUT, -1)], scaled.reshape(3, 64)[1].double())
    scale = Site(1, 9, INPUT + SCALE, -1, 1)  # block 1's fp16 scale one step up: that block's values, no other
    with rounding.recording(Ledger({scale: int(ledger.codes[(1, 9, INPUT + SCALE, -1)][1]) + 1})):
        stepped = rounding.q8_0_round(x, 1, INPUT, -1, [4, 7, 9])
    assert (stepped != plain).nonzero()[:, 0].unique().tolist() == [2]
    assert set((stepped != plain).nonzero()[:, 1].tolist()) <= set(range(32, 64))
    with pytest.raises(ValueError, match="rows \\[2, K\\] for 2 tokens"), rounding.recording(Ledger()):
        rounding.q8_0_round(x, 1, DOWN, 0, [1, 2])


def test_near_ties_are_values_within_the_factor_of_the_site_noise_of_a_boundary() -> None:
    gold_row = torch.tensor([17.5002, 3.1, -14.49995, 40.0] * 8, dtype=torch.float64)
    noise = torch.tensor([1e-4, -1e-4] * 16, dtype=torch.float64)
    gold, base = Ledger(), Ledger()
    gold.rows[(1, 4, INPUT, -1)], base.rows[(1, 4, INPUT, -1)] = gold_row, gold_row + noise
    ties = near_ties(base, gold, 2.5)  # window 2.5e-4: 17.5002 (2e-4 away) and -14.49995 (5e-5 away)
    assert {t.site.element % 4 for t in ties} == {0, 2} and len(ties) == 16
    assert ties[0].distance < ties[-1].distance  # the most ambiguous first
    first = next(t for t in ties if t.site.element == 0)
    assert (first.code, first.other) == (18, 17)
    third = next(t for t in ties if t.site.element == 2)
    assert (third.code, third.other) == (-14, -15)
    assert {t.site.element % 4 for t in near_ties(base, gold, 1.0)} == {2}  # a narrower window keeps the closer
    gold.forced = {first.site: 17}
    assert first.site not in {t.site for t in near_ties(base, gold, 2.5)}  # a forced rounding is no longer a tie


@pytest.fixture(scope="module")
def ctx() -> CheckContext:
    target = resolve_target("k3-tp4")
    endpoint = SimpleNamespace(precision=get_precision("w4a8-q8act"), dtype=torch.float32, accepted=(),
                               excuse_roundings=True)
    return CheckContext(target, torch.device("cpu"), 0, torch.Generator(), "quick", {}, endpoint)  # type: ignore[arg-type]


SEQ = [int(t) for t in torch.randint(0, 4000, (24,), generator=torch.Generator().manual_seed(3))]
FIRST = 4


def _centred(rows: torch.Tensor) -> torch.Tensor:
    return rows - rows.mean(dim=1, keepdim=True)


def _endpoint(ctx: CheckContext, forced: dict[Site, int]) -> tuple[torch.Tensor, float]:
    """The declared-precision oracle with `forced` roundings, and the bar over the plain runs."""
    cand = _oracle_run(ctx, SEQ, FIRST, torch.float32, forced)[0]
    plain = score(ctx, SEQ, FIRST)
    return cand, FACTOR * rel_rms(_centred(plain.base), _centred(plain.gold))


def _distance(cand: torch.Tensor) -> object:
    return lambda s: rel_rms(_centred(cand), _centred(s.gold))


def test_a_near_tie_taken_the_other_way_is_excused_and_named(ctx: CheckContext) -> None:
    scores = score(ctx, SEQ, FIRST)
    ties = scores.near_ties(FACTOR)
    assert ties, "k3-tp4 rounds no value near a boundary on this sequence"
    moved = []
    for tie in ties[:8]:
        cand, bar = _endpoint(ctx, {tie.site: tie.other})
        moved.append((rel_rms(_centred(cand), _centred(scores.gold)) / bar, tie, cand, bar))
    ratio, tie, cand, bar = max(moved, key=lambda m: m[0])
    assert ratio > 1.0, f"no near-tie flip moves the rows beyond the bar ({ratio:.3g}x)"
    resolved, notes = resolve_roundings(ctx, SEQ, FIRST, scores, _distance(cand), bar, FACTOR)  # type: ignore[arg-type]
    assert 1 <= len(resolved.forced) <= MAX_FORCED and tie.site in resolved.forced, (resolved.forced, notes)
    assert rel_rms(_centred(cand), _centred(resolved.gold)) <= bar
    assert any(f"rounding near-tie excused at {tie.site.describe()}" in n for n in notes), notes


def test_a_code_far_from_a_boundary_is_not_excused(ctx: CheckContext) -> None:
    """The control: the same one-code step at a value far from any boundary is a fault, and stays one."""
    scores = score(ctx, SEQ, FIRST)
    assert scores.ledgers is not None
    gold = scores.ledgers[1]
    key = min(k for k in gold.rows if k[2] == INPUT)
    row = gold.rows[key]
    element = int(((row - row.floor() - 0.5).abs() * (row.abs() < 120)).argmax())  # a value near an integer
    site = Site(key[0], key[1], key[2], key[3], element)
    cand, bar = _endpoint(ctx, {site: int(row[element].round()) + 1})
    before = rel_rms(_centred(cand), _centred(scores.gold))
    assert before > bar, f"the one-code fault moves the rows only {before:.3g} (bar {bar:.3g})"
    resolved, notes = resolve_roundings(ctx, SEQ, FIRST, scores, _distance(cand), bar, FACTOR)  # type: ignore[arg-type]
    assert resolved is scores and not resolved.forced, notes
    assert not any("excused at" in n for n in notes), notes


def test_scores_of_plain_dtypes_round_nothing(ctx: CheckContext) -> None:
    plain = SimpleNamespace(precision=get_precision("float32"), dtype=torch.float32, accepted=())
    other = CheckContext(ctx.target, ctx.device, 0, torch.Generator(), "quick", {}, plain)  # type: ignore[arg-type]
    scores = score(other, SEQ, FIRST)
    assert not scores.rounded and scores.near_ties(FACTOR) == [] and isinstance(scores, Scores)


def _one_tie_endpoint(ctx: CheckContext) -> tuple[rounding.NearTie, torch.Tensor, float]:
    """The near-tie whose other code moves the rows farthest beyond the bar, the endpoint computing so, and the
    bar over the plain runs."""
    ties = score(ctx, SEQ, FIRST).near_ties(FACTOR)
    moved = [(rel_rms(_centred(c), _centred(score(ctx, SEQ, FIRST).gold)) / b, t, c, b)
             for t in ties[:8] for c, b in [_endpoint(ctx, {t.site: t.other})]]
    _, tie, cand, bar = max(moved, key=lambda m: m[0])
    return tie, cand, bar


@pytest.mark.parametrize("cap", ["plausible", "run"])
def test_the_excuse_takes_no_more_roundings_than_plausible_or_left_in_the_run(
        ctx: CheckContext, cap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint that one near-tie explains (test_a_near_tie_taken_the_other_way_is_excused_and_named) is not
    excused when a correct implementation would plausibly need none, or when the run already excused RUN_CAP."""
    tie, cand, bar = _one_tie_endpoint(ctx)
    scores = score(ctx, SEQ, FIRST)
    saved = ctx.cache.pop(eo.EXCUSED, None)
    try:
        if cap == "plausible":
            monkeypatch.setattr(eo, "plausible", lambda expected: 0)
        else:
            ctx.cache[eo.EXCUSED] = {(0, 1, 2): {Site(9, i, INPUT, -1, 0): 0 for i in range(eo.RUN_CAP)}}
        resolved, notes = resolve_roundings(ctx, SEQ, FIRST, scores, _distance(cand), bar, FACTOR)  # type: ignore[arg-type]
        assert resolved is scores and not resolved.forced, notes
        assert any("at most 0 excused here" in n for n in notes), notes
    finally:
        ctx.cache.pop(eo.EXCUSED, None)
        if saved is not None:
            ctx.cache[eo.EXCUSED] = saved


def _judged(ctx: CheckContext, cand: torch.Tensor) -> tuple[Trial, Result]:
    """endpoint.logprobs.topk's trial over an endpoint whose rows on SEQ are `cand`, and its result."""
    saved = ctx.cache.pop(eo.EXCUSED, None)

    def rows(scores: Scores) -> Rows:
        return Rows(cand, scores.gold, scores.base, [f"seq position {p}" for p in range(cand.shape[0])])

    try:
        trial = _measured_trial(ctx, [Answer(SEQ, FIRST, rows)], [], "all rows")
        return trial, evaluate_trial(REGISTRY.get("endpoint.logprobs.topk"), trial)
    finally:
        ctx.cache.pop(eo.EXCUSED, None)
        if saved is not None:
            ctx.cache[eo.EXCUSED] = saved


def _noise_before_forcing(ctx: CheckContext) -> float:
    plain = score(ctx, SEQ, FIRST)
    assert plain.locked is not None
    return rel_rms(_centred(plain.locked), _centred(plain.gold))


def test_the_bar_is_the_one_measured_before_anything_is_forced(ctx: CheckContext) -> None:
    """A logprob trial over an endpoint that one near-tie explains: "pass, 1 rounding excused", its bar the
    oracle's own noise on the rows before forcing (the locked run), which forcing would have moved."""
    tie, cand, _ = _one_tie_endpoint(ctx)
    trial, result = _judged(ctx, cand)
    before = _noise_before_forcing(ctx)
    assert trial.bar == pytest.approx(EXCUSED_BAR_FACTOR * before, rel=1e-12)
    assert result.status is Status.EXCUSED and result.metrics["excused_rounding_near_ties"] >= 1, result.notes
    forced = score(ctx, SEQ, FIRST, {tie.site: tie.other})
    assert forced.locked is not None
    after = rel_rms(_centred(forced.locked), _centred(forced.gold))
    assert abs(after - before) > 1e-3 * before  # a bar re-measured after forcing would differ: the test can tell


def test_an_excused_pass_must_end_within_1_5x_the_oracles_own_distance(ctx: CheckContext) -> None:
    """The same endpoint with seeded noise of 3x the oracle's own distance on top: the near-tie still brings it
    within the check's bar (5.1x), but an excuse may only carry an endpoint as near the gold as the oracle's own run
    (1.5x): FAIL, with the excused roundings counted."""
    tie, cand, _ = _one_tie_endpoint(ctx)
    before = _noise_before_forcing(ctx)
    gold = _centred(score(ctx, SEQ, FIRST, {tie.site: tie.other}).gold)
    z = _centred(torch.randn(cand.shape, generator=torch.Generator().manual_seed(5), dtype=cand.dtype))
    noisy = cand + 3.0 * before * gold.pow(2).mean().sqrt() * z / z.pow(2).mean().sqrt()
    trial, result = _judged(ctx, noisy)
    assert result.metrics["excused_rounding_near_ties"] >= 1, result.notes
    assert EXCUSED_BAR_FACTOR * before < result.metric < FACTOR * before, (result.metric, before)
    assert result.status is Status.FAIL, result.notes
    assert trial.bar == pytest.approx(EXCUSED_BAR_FACTOR * before, rel=1e-12)
