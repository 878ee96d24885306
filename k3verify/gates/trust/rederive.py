"""What `serve` re-derives from a report before it believes it, with no key: every result's status from its metric,
bar and control; the suite's whole check list; the run's dtypes from the checks that ran.

Threat model (README "Serving safely"): someone edits report.json and nothing else. An edit that leaves the report
self-consistent (a status flipped along with its counts, a check list cut down with the counts fixed, dtypes
widened) is caught here, because each of those fields is re-derived from others the same code decides with
(gates/core/compare.within_bar, gates/core/evaluate.status_of, gates/core/suite's selection) and from the registry's
bars. What this cannot catch without a key: an edit of the measurements themselves (metrics, the noise a bar derives
from) made consistently, which the report index (gates/report/index.py) catches as long as the index is not edited
too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from k3verify.gates.core.binding import dtypes_of_run
from k3verify.gates.core.check import Check
from k3verify.gates.core.compare import BF16_MAX_FAIL_FRACTION, Kind, within_bar
from k3verify.gates.core.evaluate import status_of
from k3verify.gates.core.excused import excused_count
from k3verify.gates.core.noise import NoiseError, derive_bar

SHOWN = 8  # missing check ids named in a refusal


def number(value: Any) -> float | None:
    """A report number: JSON stores NaN / Inf as the strings "nan" / "inf" / "-inf"."""
    if value is None:
        return None
    return float(value)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def admitted_bar(result: Mapping[str, Any], check: Check) -> tuple[float | None, str | None]:
    """(the bar this result may be judged by, None) or (None, why its bar is not the registered one)."""
    rid, stored = result["id"], number(result["bar"])
    if check.kind is Kind.BITEXACT:
        return None, None if stored is None else f"result {rid} is bit-exact but carries a bar {stored}"
    if check.kind is Kind.BF16:
        if stored is None or not _close(stored, BF16_MAX_FAIL_FRACTION):
            return None, f"result {rid} carries bf16 bar {stored}; the bf16 fail budget is {BF16_MAX_FAIL_FRACTION:g}"
        return stored, None
    if stored is None or not math.isfinite(stored) or stored <= 0:
        return None, f"result {rid} carries RMS bar {stored}, not a positive number"
    if check.noise is not None:
        record = result.get("noise") or {}
        try:
            derived = derive_bar(float(record["value"]), str(record["dtype"]))[0]
        except (KeyError, TypeError, ValueError, NoiseError) as exc:
            return None, f"result {rid}: its bar derives from noise, but its noise record cannot derive one ({exc})"
        if not _close(derived, stored):
            return None, f"result {rid} carries bar {stored:.6g}; its noise record derives {derived:.6g}"
        return stored, None
    assert check.bar is not None  # make_check: an RMS check has a noise source or a fixed bar
    if result["bar_source"] == "measured":
        if stored > check.bar * (1 + 1e-12):
            return None, f"result {rid} carries a measured bar {stored:.6g} above its registered cap {check.bar:g}"
        return stored, None
    if not _close(stored, check.bar):
        return None, f"result {rid} carries bar {stored:.6g}; the check's registered bar is {check.bar:g}"
    return stored, None


def result_problem(result: Mapping[str, Any], check: Check | None) -> str | None:
    """Why this result's status is not what its own numbers decide (None: it is), by the rules the run used."""
    rid, status = result["id"], result["status"]
    if check is None:
        return f"result {rid} names no check of this k3verify"
    if result["kind"] != check.kind.value:
        return f"result {rid} says kind {result['kind']!r}; the check is {check.kind.value!r}"
    metric, control = number(result["metric"]), result["control"]
    if status in ("skipped", "error"):
        if metric is not None or control is not None:
            return f"result {rid} says {status!r} but carries a metric or a control outcome, as only a run check does"
        return None
    if metric is None or control is None or number(control["metric"]) is None:
        return f"result {rid} says {status!r} with no metric or control metric to decide it by"
    bar, problem = admitted_bar(result, check)
    if problem is not None:
        return problem
    control_metric = number(control["metric"])
    assert control_metric is not None
    candidate_passed = within_bar(check.kind, metric, bar)
    control_passed = within_bar(check.kind, control_metric, bar)
    if control["status"] != ("pass" if control_passed else "fail"):
        return (f"result {rid}: its control says {control['status']!r}, but the control's metric {control_metric:.3g} "
                f"against bar {bar} makes it {'pass' if control_passed else 'fail'!r}")
    decided = status_of(candidate_passed, control_passed, excused_count(result["metrics"])).value
    if decided != status:
        where = "bit-exact" if bar is None else f"bar {bar:.3g}"
        return (f"result {rid} says {status!r}, but its metric {metric:.3g} against its {where} ({check.kind.value}), "
                f"with its control {'passing' if control_passed else 'caught'}, makes it {decided!r}")
    return None


def check_list_problem(results: Sequence[Mapping[str, Any]], expected: Sequence[str], suite: str) -> str | None:
    """Why the results are not the suite's whole check list, each once (None: they are)."""
    seen = Counter(r["id"] for r in results)
    twice = sorted(i for i, n in seen.items() if n > 1)
    if twice:
        return f"result(s) {', '.join(twice[:SHOWN])} appear more than once"
    missing = [i for i in expected if i not in seen]
    if not missing:
        return None
    more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    return (f"it holds {len(expected) - len(missing)} of the {len(expected)} checks of the {suite} suite; missing: "
            f"{', '.join(missing[:SHOWN])}{more}")


def dtypes_problem(data: Mapping[str, Any]) -> str | None:
    """Why run.dtypes is not the dtypes its checks that ran built the served model in (None: it is)."""
    claimed = sorted(data["run"]["dtypes"])
    ran = dtypes_of_run((r["status"], r["serving_dtypes"]) for r in data["results"])
    if claimed == ran:
        return None
    return f"its run.dtypes {claimed} is not what its checks ran: they built the served model in {ran} only"


def report_problem(data: Mapping[str, Any], registered: Mapping[str, Check], expected: Sequence[str]) -> str | None:
    """The first reason (None: none) to disbelieve a report: a status its numbers do not give (judged by the
    `registered` checks' kinds and bars), a check of `expected` (its suite's gate list) missing, dtypes its checks
    did not run."""
    for result in data["results"]:
        if result["id"].startswith("gates.import.") and result["status"] == "error":
            continue  # a check module that failed to import: an error result, which fails the verdict anyway
        problem = result_problem(result, registered.get(result["id"]))
        if problem is not None:
            return problem
    return check_list_problem(data["results"], expected, data["run"]["suite"]) or dtypes_problem(data)
