"""A logprob check judges all its answers' rows together, and an excused result by EXCUSED_BAR_FACTOR x the
oracle's own distance: the near-tie search must aim at that, over every answer that sits beyond it. Here two
answers each carry one rounding taken the other way: the first far beyond the check's bar, the second within it on
its own (3x the oracle's distance) but beyond what an excused result may keep. Excusing the first alone leaves
the answers together beyond 1.5x; excusing both passes. Synthetic rows and oracle: no model runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from k3verify.gates.checks.endpoint import tokens
from k3verify.gates.checks.endpoint.tokens import BAR_FACTOR, EXCUSED_BAR_FACTOR, Answer, Rows, _measured_trial
from k3verify.gates.core.check import REGISTRY, CheckContext, Status
from k3verify.gates.core.evaluate import evaluate_trial
from k3verify.gates.shared import endpoint_oracle as eo
from k3verify.oracle.precision import get_precision
from k3verify.target import resolve_target

NOISE = 1e-5  # the oracle's own rel RMS on every answer's rows
SEQS = ((1, 2, 3, 4), (5, 6, 7, 8))
FLIP = {SEQS[0]: 1e3, SEQS[1]: 3.0}  # what each answer's rounding taken the other way adds, in units of NOISE


@dataclass
class FakeScores:
    """The oracle's rows for one answer: `forced` holds the rounding excused, if any."""

    seq: tuple[int, ...]
    forced: dict[Any, int] = field(default_factory=dict)
    rounded: bool = True

    def for_bar(self) -> FakeScores:
        return self


def _rows(seq: tuple[int, ...]) -> Any:
    g = torch.Generator().manual_seed(sum(seq))
    gold = torch.randn(8, 5, generator=g, dtype=torch.float64)
    size = gold.pow(2).mean().sqrt()
    base = gold + NOISE * size * torch.randn(8, 5, generator=g, dtype=torch.float64)
    own = gold + NOISE * size * torch.randn(8, 5, generator=g, dtype=torch.float64)
    flip = FLIP[seq] * NOISE * size * torch.randn(8, 5, generator=g, dtype=torch.float64)

    def rows(scores: FakeScores) -> Rows:
        cand = own + (flip if not scores.forced else 0.0)  # the gold with the rounding forced explains the flip
        return Rows(cand, gold, base, [f"{seq} position {p}" for p in range(8)])
    return rows


def _resolve(ctx: CheckContext, seq: list[int], first: int, scores: FakeScores, distance: Any, bar: float,
             factor: float, **kw: Any) -> tuple[FakeScores, list[str]]:
    forced = FakeScores(tuple(seq), {"tie": 1})
    if distance(forced) < distance(scores):
        ctx.cache.setdefault(eo.EXCUSED, {})[tuple(seq)] = dict(forced.forced)
        return forced, [f"rounding near-tie excused at {seq}"]
    return scores, []


@pytest.fixture
def ctx(monkeypatch: pytest.MonkeyPatch) -> CheckContext:
    monkeypatch.setattr(tokens, "score", lambda ctx, seq, first: FakeScores(tuple(seq)))
    monkeypatch.setattr(tokens, "resolve_roundings", _resolve)
    endpoint = SimpleNamespace(precision=get_precision("w4a8-q8act"), dtype=torch.float32, accepted=(),
                               excuse_roundings=True)
    return CheckContext(resolve_target("k3-tp4"), torch.device("cpu"), 0, torch.Generator(), "quick", {},
                        endpoint)  # type: ignore[arg-type]


def _judge(ctx: CheckContext, seqs: tuple[tuple[int, ...], ...]) -> tuple[Any, Any]:
    answers = [Answer(list(seq), 1, _rows(seq)) for seq in seqs]
    trial = _measured_trial(ctx, answers, [], "synthetic rows")
    return trial, evaluate_trial(REGISTRY.get("endpoint.logprobs.topk"), trial)


def test_the_second_answers_rounding_is_searched_too(ctx: CheckContext) -> None:
    one = _rows(SEQS[1])(FakeScores(SEQS[1]))
    alone = tokens._distance(one) / tokens._noise([one])
    assert EXCUSED_BAR_FACTOR < alone < BAR_FACTOR[torch.float32], alone  # within the check's bar on its own
    trial, result = _judge(ctx, SEQS)
    assert result.status is Status.EXCUSED, result.notes
    assert result.metrics["excused_rounding_near_ties"] == 2, result.notes
    assert set(ctx.cache[eo.EXCUSED]) == set(SEQS)


def test_excuses_that_leave_the_answers_beyond_the_bar_are_withdrawn(ctx: CheckContext,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The second answer's flip too large for the oracle to explain (the fake resolves only the first): the
    first's excuse does not bring both within the check's bar, so none is kept or recorded for the run."""
    def first_only(ctx: CheckContext, seq: list[int], *args: Any, **kw: Any) -> tuple[FakeScores, list[str]]:
        return (args[1], []) if tuple(seq) == SEQS[1] else _resolve(ctx, seq, *args, **kw)

    monkeypatch.setitem(FLIP, SEQS[1], 1e3)
    monkeypatch.setattr(tokens, "resolve_roundings", first_only)
    trial, result = _judge(ctx, SEQS)
    assert result.status is Status.FAIL and result.metrics["excused_rounding_near_ties"] == 0, result.notes
    assert not ctx.cache.get(eo.EXCUSED), ctx.cache.get(eo.EXCUSED)
    assert trial.bar == pytest.approx(BAR_FACTOR[torch.float32] * tokens._noise(
        [_rows(s)(FakeScores(s)) for s in SEQS]), rel=1e-12)
