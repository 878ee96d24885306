"""Which known convention explains an endpoint's distance from the oracle.

When an endpoint's outputs disagree with the oracle, "tokens differ" is the least useful answer. The oracle is
evaluated again under each alternative convention of the catalog (oracle/conventions.py: an eps, a precision, a
gate form, each naming the implementations known to use it), on the very sequences the endpoint answered, and each
alternative is ranked by how much of the endpoint's distance it removes. Alternatives the data cannot tell apart
(their remaining distances within TIE_REL of each other) form one tie group; alternatives that do not move the
oracle on these sequences at all are listed as not identifiable here. It only diagnoses: no verdict changes.

The distance is endpoint.logprobs.topk's: the endpoint's top-k logprobs at the gold's top-k tokens, each row
centred, relative RMS against the gold (one precision above the declared one), with the rounding near-ties that
check excused (oracle/rounding.py) taken as it took them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from k3verify.gates.core.check import CheckContext
from k3verify.gates.shared import builders
from k3verify.gates.shared.endpoint_oracle import excused_roundings
from k3verify.oracle import rounding
from k3verify.oracle.conventions import Assignment, alternatives_for, applied
from k3verify.oracle.precision import Precision
from k3verify.oracle.rounding import Ledger

TIE_REL = 0.10  # remaining distances within 10% of each other: the data cannot tell those alternatives apart
MIN_EXPLAINED = 0.5  # an explanation must remove at least half of the distance to be named as one
UNMOVED = 1e-9  # an alternative that moves no row by more than this (relative) is not identifiable here


@dataclass
class Candidate:
    assignment: str  # NAME=VALUE
    site: str
    released: str
    used_by: list[str]
    distance: float
    explained: float  # share of the baseline distance removed, 1 - distance / baseline


@dataclass
class Explanation:
    baseline: float  # the endpoint's distance from the oracle as evaluated (accepted conventions applied)
    groups: list[list[Candidate]]  # ranked; each a tie group
    unidentifiable: list[str]
    rows: int
    seconds: float
    accepted: list[str] = field(default_factory=list)
    excused_roundings: int = 0  # rounding near-ties the checks excused, taken as they took them

    def headline(self) -> str:
        if not self.groups:
            return f"no catalog convention moves the oracle on these sequences (distance {self.baseline:.3g})"
        best = self.groups[0]
        if best[0].explained < MIN_EXPLAINED:
            return (f"no catalog convention explains the distance {self.baseline:.3g}: the closest, "
                    f"{best[0].assignment}, removes {best[0].explained:.0%} of it")
        names = " / ".join(f"{c.site}: {c.assignment} (released {c.released})" for c in best)
        seen = sorted({u.split(" ", 1)[0] for c in best for u in c.used_by})
        return (f"best explained by {names} -- distance {self.baseline:.3g} -> {best[0].distance:.3g} "
                f"({best[0].explained:.0%} explained); seen in {', '.join(seen) or 'no known implementation'}")

    def as_dict(self) -> dict[str, Any]:
        return {"headline": self.headline(), "baseline": self.baseline, "rows": self.rows, "seconds": self.seconds,
                "accepted": self.accepted, "excused_roundings": self.excused_roundings,
                "groups": [[asdict(c) for c in g] for g in self.groups],
                "unidentifiable": self.unidentifiable}


@dataclass
class Rows:
    """What the distance needs per answer: the sequence, where its answer starts, and at each compared position
    the endpoint's listed {token: logprob}."""

    seq: list[int]
    first: int
    positions: list[int]
    listed: list[dict[int, float]]


def answer_rows(answers: Sequence[Any]) -> list[Rows]:
    """The greedy answers (gates/shared/endpoint_common.Greedy) as Rows: positions with listed alternatives."""
    out = []
    for g in answers:
        steps = g.answer.steps[: len(g.tokens)]
        at = [p for p, s in enumerate(steps) if s.top]
        if at:
            out.append(Rows(g.prompt + g.tokens, len(g.prompt), at, [dict(steps[p].top) for p in at]))
    return out


def _gold_rows(ctx: CheckContext, rows: Rows, dtype: torch.dtype) -> torch.Tensor:
    """The gold's rows at the compared positions, with the rounding near-ties the checks excused on this sequence
    taken as they took them (oracle/rounding.py)."""
    model = builders.reference_model(ctx, dtype)
    with torch.no_grad(), rounding.recording(Ledger(excused_roundings(ctx, rows.seq))):
        logits = model(torch.tensor(rows.seq, device=ctx.device)).logits[rows.first - 1: len(rows.seq) - 1]
    return torch.log_softmax(logits.double().cpu(), dim=-1)[rows.positions]


def distance(answers: list[Rows], golds: list[torch.Tensor], k: int) -> float:
    """endpoint.logprobs.topk's measure: the endpoint's values at the gold's top-k tokens (an unlisted one at the
    lowest listed value), each row centred, relative RMS against the gold."""
    cand, ref = [], []
    for rows, gold in zip(answers, golds, strict=True):
        for listed, row in zip(rows.listed, gold, strict=True):
            top = row.topk(k).indices.tolist()
            floor = min(listed.values())
            cand.append([listed.get(t, floor) for t in top])
            ref.append(row[top].tolist())
    c, r = torch.tensor(cand, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    c, r = c - c.mean(dim=1, keepdim=True), r - r.mean(dim=1, keepdim=True)
    return float((c - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-300))


def explain(ctx: CheckContext, answers: Sequence[Any], accepted: Sequence[Assignment], precision: Precision,
            k: int) -> Explanation:
    """Rank every catalog alternative that applies to the target by the distance left when the oracle (the gold of
    the declared precision, in its emulated arithmetic) uses it."""
    gold_dtype = precision.gold_dtype
    start = time.perf_counter()
    rows = answer_rows(answers)
    if not rows:
        raise ValueError("no endpoint answer lists top-k logprobs: nothing to explain")
    with applied(list(accepted)), precision.emulated():
        base_golds = [_gold_rows(ctx, r, gold_dtype) for r in rows]
    baseline = distance(rows, base_golds, k)
    scored: list[Candidate] = []
    unmoved: list[str] = []
    taken = {a.convention.name for a in accepted}
    for alt in alternatives_for(ctx.cfg, gold_dtype):
        if alt.convention.name in taken:
            continue
        try:
            with applied([*accepted, alt]), precision.emulated():
                golds = [_gold_rows(ctx, r, gold_dtype) for r in rows]
        except ValueError:  # sets a site an accepted convention already set otherwise
            continue
        moved = max(float((g - b).abs().max()) for g, b in zip(golds, base_golds, strict=True))
        name = alt.text
        if moved <= UNMOVED * max(float(b.abs().max()) for b in base_golds):
            unmoved.append(name)
            continue
        d = distance(rows, golds, k)
        used_by = list(alt.alternative.used_by) if alt.alternative is not None else []
        scored.append(Candidate(name, alt.convention.site, alt.convention.released, used_by, d,
                                1.0 - d / baseline if baseline > 0 else 0.0))
    scored.sort(key=lambda c: c.distance)
    groups: list[list[Candidate]] = []
    for c in scored:
        if groups and c.distance <= groups[-1][0].distance * (1 + TIE_REL):
            groups[-1].append(c)
        else:
            groups.append([c])
    return Explanation(baseline, groups, unmoved, sum(len(r.positions) for r in rows), time.perf_counter() - start,
                       [a.text for a in accepted], sum(len(excused_roundings(ctx, r.seq)) for r in rows))
