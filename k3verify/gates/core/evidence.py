"""No PASS without evidence: which results show that the model's outputs were actually compared.

A check may skip for a good reason (a server without prompt logprobs, a CUDA-only kernel on the CPU), but a run
in which every check that compares the model's outputs skipped has verified nothing, however green the rest.
Evidence is judged per family of checks; a family is in play when the run selected any of its members, and then
its evidence must have run (passed or failed, not skipped), with enough compared positions where that is counted:

- model: in play when the run has a whole-model check (`model.logits.*`, `model.layerwise.*`, `served.*`,
  `serving.greedy.vs_oracle`); evidence: one of them ran.
- parallel: in play with any `dist.*` check (`--tp` / `--ep`); evidence: a `dist.*logits` check or `dist.greedy`.
- endpoint: in play with any `endpoint.*` check (`--endpoint`); evidence: `endpoint.greedy.tokens` over at least
  16 generated positions, and one `endpoint.logprobs.*` check.

A run with no result that ran at all is inconclusive too, and so is a run in which any check skipped for size (its
reason starts with SIZE_SKIP): at real size a check runs whole, layer-streamed or on a stated slice, or the run has
not verified the model. Works on report.json result dicts, so `serve` and every report consumer recompute it from
the results instead of trusting a stored verdict.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

RAN = ("pass", "excused", "fail", "vacuous", "error")
SIZE_SKIP = "real size:"  # the reason a check skipped because the model is too large to build whole
MIN_ENDPOINT_POSITIONS = 16  # two quick-suite answers of 8 tokens: one short answer proves little


@dataclass(frozen=True)
class Requirement:
    """`patterns` (globs over check ids), at least one of which must have run; `positions`: the metric that counts
    compared positions and its minimum, summed over the matching results that ran."""

    patterns: tuple[str, ...]
    positions: tuple[str, int] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    members: tuple[str, ...]  # globs: the family is in play when any result matches one
    requirements: tuple[Requirement, ...]


WHOLE_MODEL = ("model.logits.*", "model.layerwise.*", "served.*", "serving.greedy.vs_oracle")
FAMILIES = (
    Family("model", WHOLE_MODEL, (Requirement(WHOLE_MODEL),)),
    Family("parallel", ("dist.*",), (Requirement(("dist.*logits", "dist.greedy")),)),
    Family("endpoint", ("endpoint.*",), (
        Requirement(("endpoint.greedy.tokens",), ("positions", MIN_ENDPOINT_POSITIONS)),
        Requirement(("endpoint.logprobs.*",)),
    )),
)


def _matches(check_id: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(check_id, p) for p in patterns)


def _metric(result: Mapping[str, Any], name: str) -> float:
    value = (result.get("metrics") or {}).get(name, 0.0)
    return float(value) if isinstance(value, int | float) else 0.0


def _unmet(requirement: Requirement, results: Sequence[Mapping[str, Any]]) -> str | None:
    matching = [r for r in results if _matches(str(r["id"]), requirement.patterns)]
    ran = [r for r in matching if r["status"] in RAN]
    names = " or ".join(requirement.patterns)
    if not ran:
        if not matching:
            return f"{names} was not selected"
        skipped = "; ".join(f"{r['id']}: {r.get('reason') or 'skipped'}" for r in matching)
        return f"{names} did not run ({skipped})"
    if requirement.positions is not None:
        metric, least = requirement.positions
        counted = sum(_metric(r, metric) for r in ran)
        if counted < least:
            return f"{names} compared {counted:g} {metric}, fewer than the {least} evidence needs"
    return None


def missing_evidence(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why the run's results do not show model outputs compared; empty when they do."""
    if not any(r["status"] in RAN for r in results):
        return ["no check ran (every selected check skipped)"]
    reasons = []
    sized_out = [str(r["id"]) for r in results if r["status"] == "skipped" and
                 str(r.get("reason") or "").startswith(SIZE_SKIP)]
    if sized_out:
        reasons.append(f"{len(sized_out)} check(s) skipped for size, a PASS needs none: {', '.join(sized_out[:6])}"
                       + (" …" if len(sized_out) > 6 else ""))
    for family in FAMILIES:
        if not any(_matches(str(r["id"]), family.members) for r in results):
            continue
        for requirement in family.requirements:
            why = _unmet(requirement, results)
            if why is not None:
                reasons.append(f"{family.name}: {why}")
    return reasons
