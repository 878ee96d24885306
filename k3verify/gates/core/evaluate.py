"""The gate rules: one Trial -> one Result (comparison, control, bar, instrument, localization).

A candidate that fails its comparison fails; else a control that passes makes the check vacuous; else it
passes. The bar of a noise-barred check is resolved here (gates/core/noise.py), from the recording or from
the pair the check measured on its own inputs.
"""

from __future__ import annotations

import math
from typing import Any

from k3verify.gates.core.check import Check, ControlOutcome, Result, Status, Trial
from k3verify.gates.core.compare import (
    THIN_MARGIN,
    Comparison,
    Kind,
    compare,
    error_over_position,
    localize_layers,
    rel_rms_error,
)
from k3verify.gates.core.excused import excused_count
from k3verify.gates.core.noise import NoiseLookup, measure, resolve


def evaluate_trial(check: Check, trial: Trial, noise: NoiseLookup | None = None) -> Result:
    """The gate rules: candidate fails -> fail; else control passes -> vacuous; else pass.
    NaN/Inf fail inside compare(); exceptions and skips are handled by the runner. `noise` is the
    recording for a noise-barred check (None: the check's own Trial.noise decides the bar)."""
    if not isinstance(trial, Trial):
        raise TypeError(f"check {check.id} returned {type(trial).__name__}; it must return a Trial")
    bar, noise_record = _bar(check, trial, noise)
    rms_bar = bar if check.kind is Kind.RMS else None
    comp = compare(check.kind, trial.reference, trial.candidate, rms_bar)
    ctrl = compare(check.kind, trial.reference, trial.control, rms_bar)
    control = ControlOutcome("pass" if ctrl.passed else "fail", check.control, ctrl.metric,
                             comparison_metrics(ctrl), ctrl.reason)
    result = Result(
        id=check.id, component=check.component, level=check.level, kind=check.kind.value, bar=bar,
        bar_reason=check.bar_reason, status=Status.PASS, metric=comp.metric,
        bar_source="measured" if trial.bar is not None else check.bar_source,
        noise=noise_record,
        metrics={**comparison_metrics(comp), **{k: float(v) for k, v in trial.metrics.items()}},
        per_key={k: {"passed": c.passed, "metric": c.metric, **comparison_metrics(c)} for k, c in comp.per_key.items()},
        control=control, margin=comp.margin, worst=comp.worst, shapes=comp.shapes, dtypes=comp.dtypes,
        notes=[str(n) for n in trial.notes],
    )
    if noise_record is not None and noise_record["note"]:
        result.notes.append(noise_record["note"])
    result.status = status_of(comp.passed, ctrl.passed, excused_count(result.metrics))
    if result.status is Status.FAIL:
        result.reason = comp.reason
        if ctrl.passed:
            result.notes.append("the control passes too: even a correct candidate could not be told from a wrong one")
    elif result.status is Status.VACUOUS:
        result.reason = f"control passed ({check.control}): this check cannot tell right from wrong"
    result.thin = comp.passed and comp.margin is not None and comp.margin > THIN_MARGIN
    if trial.gold is not None:
        result.instrument = _instrument(trial, comp)
        if result.instrument["flag"]:
            result.reason = (f"{result.reason}; instrument suspect: the reference is farther from the fp64 gold "
                             f"({result.instrument['ref_to_gold']:.3g}) than the candidate "
                             f"({result.instrument['cand_to_gold']:.3g})")
    if trial.layers or trial.position_dim is not None:
        result.localization = _localize(check, trial, comp, rms_bar)
    if trial.control_layers:
        control.first_divergent_layer = localize_layers(check.kind, trial.control_layers, rms_bar)[1]
    return result


def status_of(candidate_passed: bool, control_passed: bool, excused: int = 0) -> Status:
    """The gate rule: a candidate that fails its comparison fails; else a control that passes makes the check
    vacuous; else it passes, as EXCUSED when it passed only after `excused` rounding near-ties were excused (its
    own status, never a plain pass). `serve` re-applies it to every result of a report (gates/trust/rederive.py)."""
    if not candidate_passed:
        return Status.FAIL
    if control_passed:
        return Status.VACUOUS
    return Status.EXCUSED if excused > 0 else Status.PASS


def _bar(check: Check, trial: Trial, noise: NoiseLookup | None) -> tuple[float | None, dict[str, Any] | None]:
    """The check's effective bar and the report's noise record (derived, or measured beside a fixed bar)."""
    if check.noise is not None:
        if trial.bar is not None:
            raise ValueError(f"check {check.id}: its bar derives from noise ({check.noise}); it takes no Trial.bar")
        return resolve(check.id, check.noise, noise, trial.noise)
    bar = check.bar if trial.bar is None else measured_bar(check, trial.bar)
    if trial.noise is None or bar is None:
        return bar, None
    value, dtype = measure(trial.noise)
    ratio = bar / value if value > 0 else math.inf
    return bar, {"value": value, "dtype": dtype, "source": "measured", "pair": "supplied by the check",
                 "factor": None, "floor": None, "observed": value, "why_measured": None, "note": None,
                 "derivation": f"fixed bar {bar:g} = {ratio:.3g}x this noise: {check.bar_reason}"}


def measured_bar(check: Check, bar: float) -> float:
    """A bar measured at run time (e.g. the oracle's own distance at the candidate's precision): RMS only, and
    never above the registered bar, so a noisy measurement cannot loosen the check past what was justified."""
    if check.kind is not Kind.RMS or check.bar is None:
        raise ValueError(f"check {check.id}: only RMS checks take a measured bar; this one is {check.kind.value}")
    if not 0.0 < bar <= check.bar:
        raise ValueError(f"check {check.id}: measured bar {bar:.3g} is outside (0, {check.bar:g}], the registered "
                         f"cap ({check.bar_reason})")
    return bar


def comparison_metrics(comp: Comparison) -> dict[str, float]:
    out = {"max_abs": comp.max_abs}
    for name in ("fail_fraction", "rms_ratio", "max_tol_ratio"):
        value = getattr(comp, name)
        if value is not None:
            out[name] = value
    if comp.kind is Kind.BITEXACT:
        out["mismatches"] = comp.metric
    return out


def _instrument(trial: Trial, comp: Comparison) -> dict[str, Any]:
    """PyTorch OpInfo's rule: whoever is farther from fp64 is wrong. Flag only when they disagree."""
    ref_to_gold = rel_rms_error(trial.gold, trial.reference)
    cand_to_gold = rel_rms_error(trial.gold, trial.candidate)
    return {"flag": (not comp.passed) and ref_to_gold > cand_to_gold,
            "ref_to_gold": ref_to_gold, "cand_to_gold": cand_to_gold}


def _pick(value: Any, key: str | None) -> Any:
    """The tensor to plot over position: the worst key of a dict (else its first key)."""
    if not isinstance(value, dict):
        return value
    return value[key] if key in value else next(iter(value.values()))


def _localize(check: Check, trial: Trial, comp: Comparison, rms_bar: float | None) -> dict[str, Any]:
    """Error over depth with the check's effective bar (derived or measured), and over position."""
    out: dict[str, Any] = {"per_layer": [], "first_divergent_layer": None, "per_position": []}
    if trial.layers:
        per_layer, first = localize_layers(check.kind, trial.layers, rms_bar)
        out["per_layer"] = [vars(e).copy() for e in per_layer]
        out["first_divergent_layer"] = first
    if trial.position_dim is not None:
        key = comp.worst.key if comp.worst is not None else None
        ref, cand = _pick(trial.reference, key), _pick(trial.candidate, key)
        if getattr(ref, "shape", None) == getattr(cand, "shape", None):
            out["per_position"] = [vars(e).copy() for e in error_over_position(ref, cand, trial.position_dim)]
    return out
