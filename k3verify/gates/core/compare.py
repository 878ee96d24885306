"""The three comparison kinds (BITEXACT, BF16, RMS) and the error curves used for localization.

The BF16 tolerance and fail budget are module constants on purpose: no argument or environment
variable can loosen them. Only RMS takes a per-check bar, and registration demands a reason for it.
All arithmetic happens in float64 so the instrument never adds error of its own.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

BF16_ATOL = 1e-5
BF16_RTOL = 1.6e-2
BF16_MAX_FAIL_FRACTION = 1e-4
RMS_DEFAULT_BAR = 5e-3
THIN_MARGIN = 0.8


class Kind(enum.StrEnum):
    BITEXACT = "bitexact"
    BF16 = "bf16"
    RMS = "rms"


Comparable = torch.Tensor | Mapping[str, Any] | Any


@dataclass(frozen=True)
class WorstElement:
    """The single element that decides how bad a comparison is (key is set for dict inputs)."""

    key: str | None
    flat_index: int
    index: tuple[int, ...]
    reference: float
    candidate: float


@dataclass(frozen=True)
class Comparison:
    """Outcome of one comparison. `metric` is what the bar applies to:
    BITEXACT: number of unequal elements (no bar); BF16: failing fraction; RMS: RMS(c-r)/RMS(r)."""

    kind: Kind
    passed: bool
    metric: float
    bar: float | None
    max_abs: float
    nan_or_inf: bool
    shapes: dict[str, list[int]]
    dtypes: dict[str, str]
    reason: str | None = None
    fail_fraction: float | None = None
    rms_ratio: float | None = None
    max_tol_ratio: float | None = None
    worst: WorstElement | None = None
    per_key: dict[str, Comparison] = field(default_factory=dict)

    @property
    def margin(self) -> float | None:
        """metric / bar; > THIN_MARGIN on a pass means the pass is thin. None for BITEXACT."""
        if self.bar is None:
            return None
        return self.metric / self.bar


def default_bar(kind: Kind) -> float | None:
    return {Kind.BITEXACT: None, Kind.BF16: BF16_MAX_FAIL_FRACTION, Kind.RMS: RMS_DEFAULT_BAR}[Kind(kind)]


def within_bar(kind: Kind | str, metric: float, bar: float | None) -> bool:
    """Whether a comparison's metric passes: BITEXACT no unequal element, BF16 a failing fraction under the fixed
    budget (whatever `bar` says), RMS a ratio under `bar`; a non-finite metric never passes. compare() decides with
    this, and `serve` re-decides every status of a report with it."""
    kind = Kind(kind)
    if not math.isfinite(metric):
        return False
    if kind is Kind.BITEXACT:
        return metric == 0
    if kind is Kind.BF16:
        return metric < BF16_MAX_FAIL_FRACTION
    if bar is None:
        raise ValueError("an RMS comparison needs a bar")
    return metric < bar


def compare(kind: Kind | str, reference: Comparable, candidate: Comparable, bar: float | None = None) -> Comparison:
    """Compare candidate to reference with `kind`. Tensors, dicts of tensors (key by key; the worst
    key decides) or anything torch.as_tensor accepts. Mismatched shapes or keys fail; they don't raise."""
    kind = Kind(kind)
    if bar is not None and kind is not Kind.RMS:
        raise ValueError(f"only RMS takes a bar; {kind.value} has a fixed one (got bar={bar})")
    bar = default_bar(kind) if bar is None else float(bar)
    if isinstance(reference, Mapping) or isinstance(candidate, Mapping):
        return _compare_dicts(kind, bar, reference, candidate)
    return _compare_tensors(kind, bar, _as_tensor(reference, "reference"), _as_tensor(candidate, "candidate"), None)


def _as_tensor(value: Any, side: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        kind = type(value).__name__
        raise TypeError(f"{side} must be a Tensor, a dict of Tensors or array-like; got {kind}") from exc


def _label(side: str, key: str | None) -> str:
    return side if key is None else f"{side}.{key}"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(index))


def _worst(key: str | None, flat: int, shape: Sequence[int], r: torch.Tensor, c: torch.Tensor) -> WorstElement:
    return WorstElement(key, flat, _unravel(flat, shape), float(r.reshape(-1)[flat]), float(c.reshape(-1)[flat]))


def _failed(kind: Kind, bar: float | None, shapes: dict, dtypes: dict, reason: str) -> Comparison:
    return Comparison(kind, False, math.inf, bar, math.inf, False, shapes, dtypes, reason=reason)


def _compare_tensors(
    kind: Kind, bar: float | None, ref: torch.Tensor, cand: torch.Tensor, key: str | None
) -> Comparison:
    shapes = {_label("reference", key): list(ref.shape), _label("candidate", key): list(cand.shape)}
    dtypes = {_label("reference", key): _dtype_name(ref), _label("candidate", key): _dtype_name(cand)}
    where = "" if key is None else f" [{key}]"
    if ref.shape != cand.shape:
        return _failed(kind, bar, shapes, dtypes,
                       f"shape differs{where}: reference {tuple(ref.shape)} vs candidate {tuple(cand.shape)}")
    if kind is Kind.BITEXACT and ref.dtype != cand.dtype:
        return _failed(kind, bar, shapes, dtypes,
                       f"dtype differs{where}: reference {_dtype_name(ref)} vs candidate {_dtype_name(cand)}")
    cand = cand.to(ref.device)
    nonfinite = _nonfinite(kind, bar, ref, cand, key, shapes, dtypes)
    if nonfinite is not None:
        return nonfinite
    if kind is Kind.BITEXACT:
        return _compare_bitexact(ref, cand, key, shapes, dtypes)
    r, c = ref.to(torch.float64), cand.to(torch.float64)
    diff = (c - r).abs()
    n = diff.numel()
    max_abs = float(diff.max()) if n else 0.0
    if kind is Kind.BF16:
        tol = BF16_ATOL + BF16_RTOL * r.abs()
        fails = int((diff > tol).sum())
        fraction = fails / n if n else 0.0
        tol_ratio = diff / tol
        within = within_bar(kind, fraction, bar)
        why = None if within else (f"{fails} of {n} elements{where} outside |c-r| <= {BF16_ATOL:g} + "
                                   f"{BF16_RTOL:g}|r| (fraction {fraction:.3g} >= {BF16_MAX_FAIL_FRACTION:g})")
        return Comparison(kind, within, fraction, bar, max_abs, False, shapes, dtypes, reason=why,
                          fail_fraction=fraction, max_tol_ratio=float(tol_ratio.max()) if n else 0.0,
                          worst=_worst(key, int(tol_ratio.reshape(-1).argmax()), ref.shape, r, c) if n else None)
    ratio = _rel_rms(diff, r)
    assert bar is not None  # RMS always has a bar: default_bar or the registered override
    passed = within_bar(kind, ratio, bar)
    worst = _worst(key, int(diff.reshape(-1).argmax()), ref.shape, r, c) if n else None
    reason = None if passed else (f"RMS(c-r)/RMS(r){where} = {ratio:.3g} >= bar {bar:g}"
                                  + (" (reference RMS is 0)" if float(r.norm()) == 0.0 else ""))
    return Comparison(kind, passed, ratio, bar, max_abs, False, shapes, dtypes, reason=reason,
                      rms_ratio=ratio, worst=worst)


def _nonfinite(kind: Kind, bar: float | None, ref: torch.Tensor, cand: torch.Tensor, key: str | None, shapes: dict,
               dtypes: dict) -> Comparison | None:
    """The failed comparison when either side holds a NaN or an Inf (judged in the tensors' own dtype), else None.
    Integer tensors hold neither: no mask is built for them (a byte image's mask would be as large as the image)."""
    if not (ref.is_floating_point() or ref.is_complex() or cand.is_floating_point() or cand.is_complex()):
        return None
    bad_r, bad_c = ~torch.isfinite(ref), ~torch.isfinite(cand)
    if not (bool(bad_r.any()) or bool(bad_c.any())):
        return None
    where = "" if key is None else f" [{key}]"
    # Point at the candidate's first non-finite element if it has one: that is usually the bug.
    flat = int((bad_c if bool(bad_c.any()) else bad_r).reshape(-1).nonzero()[0, 0])
    reason = (f"non-finite values{where}: reference {int(ref.isnan().sum())} NaN / {int(ref.isinf().sum())} Inf, "
              f"candidate {int(cand.isnan().sum())} NaN / {int(cand.isinf().sum())} Inf")
    return Comparison(kind, False, math.inf, bar, math.inf, True, shapes, dtypes, reason=reason,
                      worst=_worst(key, flat, ref.shape, ref, cand))


def _compare_bitexact(ref: torch.Tensor, cand: torch.Tensor, key: str | None, shapes: dict, dtypes: dict) -> Comparison:
    """Equal element for element, in the tensors' own dtype: float64 copies only of the elements that differ (a
    real-size byte image of a checkpoint is gigabytes, and three float64 copies of it filled the host)."""
    where = "" if key is None else f" [{key}]"
    differ = (ref != cand).reshape(-1).nonzero().reshape(-1)
    mismatches = differ.numel()
    if not mismatches:
        return Comparison(Kind.BITEXACT, True, 0.0, None, 0.0, False, shapes, dtypes)
    diff = (cand.reshape(-1)[differ].to(torch.float64) - ref.reshape(-1)[differ].to(torch.float64)).abs()
    flat = int(differ[int(diff.argmax())])  # the first of the largest differences, as an argmax over all would give
    return Comparison(Kind.BITEXACT, False, float(mismatches), None, float(diff.max()), False, shapes, dtypes,
                      reason=f"{mismatches} of {ref.numel()} elements differ{where}",
                      worst=_worst(key, flat, ref.shape, ref, cand))


def _rel_rms(diff: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(diff)/RMS(ref); 0 when both vanish, inf when only the reference does."""
    num, den = float(diff.norm()), float(ref.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _compare_dicts(kind: Kind, bar: float | None, reference: Any, candidate: Any) -> Comparison:
    if not (isinstance(reference, Mapping) and isinstance(candidate, Mapping)):
        kinds = f"reference {type(reference).__name__}, candidate {type(candidate).__name__}"
        return _failed(kind, bar, {}, {}, f"one side is a dict and the other is not: {kinds}")
    missing = sorted(set(reference) - set(candidate))
    extra = sorted(set(candidate) - set(reference))
    if missing or extra:
        return _failed(kind, bar, {}, {}, f"keys differ: missing in candidate {missing}, extra in candidate {extra}")
    if not reference:
        return _failed(kind, bar, {}, {}, "empty dicts: nothing was compared")
    per_key = {
        str(k): _compare_tensors(kind, bar, _as_tensor(reference[k], f"reference[{k}]"),
                                 _as_tensor(candidate[k], f"candidate[{k}]"), str(k))
        for k in reference
    }
    # The worst key decides: any failing key beats every passing one, then the larger metric wins.
    worst_key = max(per_key, key=lambda k: (not per_key[k].passed, per_key[k].metric))
    w = per_key[worst_key]
    shapes = {name: s for comp in per_key.values() for name, s in comp.shapes.items()}
    dtypes = {name: d for comp in per_key.values() for name, d in comp.dtypes.items()}
    failing = [k for k, comp in per_key.items() if not comp.passed]
    return Comparison(
        kind, not failing, w.metric, bar, max(comp.max_abs for comp in per_key.values()),
        any(comp.nan_or_inf for comp in per_key.values()), shapes, dtypes,
        reason=None if not failing else "; ".join(str(per_key[k].reason) for k in failing),
        fail_fraction=w.fail_fraction, rms_ratio=w.rms_ratio, max_tol_ratio=w.max_tol_ratio,
        worst=w.worst, per_key=per_key,
    )


@dataclass(frozen=True)
class LayerError:
    name: str
    metric: float
    passed: bool
    rel_rms: float
    max_abs: float


@dataclass(frozen=True)
class PositionError:
    position: int
    rel_rms: float
    max_abs: float


def localize_layers(
    kind: Kind | str, layers: Sequence[tuple[str, Any, Any]], bar: float | None = None
) -> tuple[list[LayerError], str | None]:
    """Compare each (name, reference, candidate) in depth order with the check's own comparison.
    Returns the per-layer errors and the first layer that fails (None if every layer passes)."""
    kind = Kind(kind)
    out: list[LayerError] = []
    first: str | None = None
    for name, ref, cand in layers:
        comp = compare(kind, ref, cand, bar if kind is Kind.RMS else None)
        rel = rel_rms_error(ref, cand)
        out.append(LayerError(str(name), comp.metric, comp.passed, rel, comp.max_abs))
        if first is None and not comp.passed:
            first = str(name)
    return out, first


def rel_rms_error(reference: Any, candidate: Any) -> float:
    """A continuous error for plots: BF16 fail fractions and BITEXACT counts are mostly 0."""
    if isinstance(reference, Mapping):
        if not isinstance(candidate, Mapping) or set(reference) != set(candidate):
            return math.inf
        return max((rel_rms_error(reference[k], candidate[k]) for k in reference), default=0.0)
    r = _as_tensor(reference, "reference").to(torch.float64)
    c = _as_tensor(candidate, "candidate").to(r.device, torch.float64)
    if r.shape != c.shape:
        return math.inf
    d = c - r
    if not bool(torch.isfinite(d).all()):
        return math.inf
    return _rel_rms(d.abs(), r)


def error_over_position(reference: torch.Tensor, candidate: torch.Tensor, position_dim: int) -> list[PositionError]:
    """Relative RMS error and max |c-r| per index along the token axis `position_dim`."""
    r = _as_tensor(reference, "reference").to(torch.float64)
    c = _as_tensor(candidate, "candidate").to(r.device, torch.float64)
    if r.shape != c.shape:
        raise ValueError(f"error_over_position needs equal shapes; got {tuple(r.shape)} and {tuple(c.shape)}")
    r, c = r.movedim(position_dim, 0).reshape(r.shape[position_dim], -1), c.movedim(position_dim, 0)
    d = (c.reshape(r.shape) - r).abs()
    out = []
    for p in range(r.shape[0]):
        finite = bool(torch.isfinite(d[p]).all())
        max_abs = float(d[p].max()) if d[p].numel() and finite else (0.0 if finite else math.inf)
        out.append(PositionError(p, _rel_rms(d[p], r[p]) if finite else math.inf, max_abs))
    return out
