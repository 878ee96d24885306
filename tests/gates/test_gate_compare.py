"""The three comparison kinds at their exact edges, with hostile values (NaN, Inf, mismatched shapes)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3verify.gates.core.compare import (
    BF16_ATOL,
    BF16_MAX_FAIL_FRACTION,
    BF16_RTOL,
    RMS_DEFAULT_BAR,
    Kind,
    compare,
)

f64 = torch.float64


def test_bf16_element_exactly_at_tolerance_passes_and_one_ulp_beyond_fails() -> None:
    """At r=0 the tolerance is exactly BF16_ATOL: |c-r| == tol passes, the next double up fails."""
    r = torch.zeros(1, dtype=f64)
    assert compare(Kind.BF16, r, torch.tensor([BF16_ATOL], dtype=f64)).passed
    assert compare(Kind.BF16, r, torch.tensor([-BF16_ATOL], dtype=f64)).passed
    beyond = math.nextafter(BF16_ATOL, 1.0)
    comp = compare(Kind.BF16, r, torch.tensor([beyond], dtype=f64))
    assert not comp.passed and comp.fail_fraction == 1.0


@pytest.mark.parametrize("ref", [3.0, -0.75, 1e4])
def test_bf16_relative_edge_just_inside_and_just_outside(ref: float) -> None:
    """The relative term scales with |r|: 1e-9 inside the edge passes, 1e-9 outside fails."""
    tol = BF16_ATOL + BF16_RTOL * abs(ref)
    r = torch.tensor([ref], dtype=f64)
    for sign in (1.0, -1.0):
        assert compare(Kind.BF16, r, r + sign * tol * (1 - 1e-9)).passed
        assert not compare(Kind.BF16, r, r + sign * tol * (1 + 1e-9)).passed


@pytest.mark.parametrize(("bad", "passed"), [(9, True), (10, False), (11, False)])
def test_bf16_fail_fraction_budget_is_strictly_below_1e_4(bad: int, passed: bool) -> None:
    """9 bad elements in 1e5 (9e-5) pass; 10 (exactly 1e-4) and 11 fail."""
    r = torch.ones(100_000, dtype=f64)
    c = r.clone()
    c[torch.arange(bad) * 997] += 1.0
    comp = compare(Kind.BF16, r, c)
    assert comp.passed is passed
    assert comp.metric == pytest.approx(bad / 100_000)
    assert comp.margin == pytest.approx(bad / 100_000 / BF16_MAX_FAIL_FRACTION)


@pytest.mark.parametrize(("scale", "passed"), [(1 - 1e-6, True), (1 + 1e-6, False)])
def test_rms_ratio_just_under_and_just_over_default_bar(scale: float, passed: bool) -> None:
    r = torch.ones(1000, dtype=f64)
    comp = compare(Kind.RMS, r, r + RMS_DEFAULT_BAR * scale)
    assert comp.passed is passed
    assert comp.rms_ratio == pytest.approx(RMS_DEFAULT_BAR * scale, rel=1e-9)


def test_rms_bar_override_is_used() -> None:
    r = torch.ones(100, dtype=f64)
    c = r + 8e-3
    assert not compare(Kind.RMS, r, c).passed
    assert compare(Kind.RMS, r, c, bar=1e-2).passed


def test_rms_zero_reference() -> None:
    """Both zero: identical, pass. Reference zero but candidate not: infinite ratio, fail with a reason."""
    z = torch.zeros(4)
    assert compare(Kind.RMS, z, z).passed
    comp = compare(Kind.RMS, z, torch.tensor([0.0, 0.0, 1e-30, 0.0]))
    assert not comp.passed and comp.metric == math.inf and "reference RMS is 0" in str(comp.reason)


def test_fixed_bars_cannot_be_overridden() -> None:
    for kind in (Kind.BF16, Kind.BITEXACT):
        with pytest.raises(ValueError, match="only RMS takes a bar"):
            compare(kind, torch.ones(2), torch.ones(2), bar=1.0)


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("side", ["reference", "candidate", "both"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_fail_every_kind(kind: Kind, side: str, value: float) -> None:
    """NaN/Inf anywhere fails, even in the same position on both sides, and the worst element points at it."""
    r = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    c = r.clone()
    for t, s in ((r, "reference"), (c, "candidate")):
        if side in (s, "both"):
            t[2, 1, 3] = value
    comp = compare(kind, r, c)
    assert not comp.passed and comp.nan_or_inf
    assert comp.worst is not None and comp.worst.index == (2, 1, 3) and comp.worst.flat_index == 2 * 20 + 5 + 3
    assert "non-finite" in str(comp.reason)


def test_bitexact_detects_one_ulp_and_reports_it() -> None:
    r = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    c = r.clone()
    c[4, 6] = torch.nextafter(c[4, 6], torch.tensor(math.inf))
    comp = compare(Kind.BITEXACT, r, c)
    assert not comp.passed and comp.metric == 1.0 and comp.margin is None
    assert comp.worst is not None and comp.worst.index == (4, 6)
    assert compare(Kind.BITEXACT, r, r.clone()).passed


def test_bitexact_dtype_mismatch_fails_even_with_equal_values() -> None:
    r = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float32)
    comp = compare(Kind.BITEXACT, r, r.to(torch.bfloat16))
    assert not comp.passed and "dtype differs" in str(comp.reason)
    assert comp.dtypes == {"reference": "float32", "candidate": "bfloat16"}


@pytest.mark.parametrize("kind", list(Kind))
def test_shape_mismatch_fails_with_reason_not_exception(kind: Kind) -> None:
    comp = compare(kind, torch.zeros(4, 3), torch.zeros(3, 4))
    assert not comp.passed and "shape differs" in str(comp.reason)
    assert comp.shapes == {"reference": [4, 3], "candidate": [3, 4]}


def test_bitexact_integer_tensors() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert compare(Kind.BITEXACT, ids, ids.clone()).passed
    assert not compare(Kind.BITEXACT, ids, ids.flip(1)).passed
    assert compare(Kind.BITEXACT, [1, 2, 3], [1, 2, 3]).passed  # array-likes (token id lists)


def test_dict_inputs_compared_key_by_key_worst_key_decides() -> None:
    r = {"logits": torch.ones(10), "state": torch.ones(4, 4)}
    c = {"logits": torch.ones(10), "state": torch.ones(4, 4)}
    c["state"][1, 2] = 2.0
    comp = compare(Kind.RMS, r, c)
    assert not comp.passed
    assert set(comp.per_key) == {"logits", "state"}
    assert comp.per_key["logits"].passed and not comp.per_key["state"].passed
    assert comp.worst is not None and comp.worst.key == "state" and comp.worst.index == (1, 2)
    assert "[state]" in str(comp.reason)


def test_dict_key_mismatch_fails() -> None:
    comp = compare(Kind.BITEXACT, {"a": torch.ones(1)}, {"b": torch.ones(1)})
    assert not comp.passed and "keys differ" in str(comp.reason)
    assert not compare(Kind.BITEXACT, {"a": torch.ones(1)}, torch.ones(1)).passed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=64),
       st.floats(-0.0155, 0.0155))
def test_bf16_accepts_any_relative_error_below_rtol(values: list[float], rel: float) -> None:
    """Property: a uniform relative error below 1.6e-2 always passes BF16; identity passes every kind."""
    r = torch.tensor(values, dtype=f64)
    assert compare(Kind.BF16, r, r * (1 + rel)).passed
    for kind in Kind:
        assert compare(kind, r, r.clone()).passed


def test_bitexact_holds_no_float64_copy_of_its_inputs() -> None:
    """A bit-exactness check of a checkpoint's bytes compares gigabytes at real size: the comparison must take about
    one byte per element (the unequal mask), not three float64 copies (24 bytes an element filled a 128 GiB host),
    and no non-finite masks for integers, which hold no NaN (two more bytes an element)."""
    from k3verify.plan.host_memory import host_peak_bytes, reset_host_peak

    n = 64 << 20
    ref = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    cand = ref.clone()
    cand[12345] ^= 1
    if not reset_host_peak():
        pytest.skip("the host's resident peak cannot be reset here (no /proc/self/clear_refs)")
    start = host_peak_bytes()
    assert start is not None
    comp = compare("bitexact", ref, cand)
    grown = host_peak_bytes() - start
    assert (comp.passed, comp.metric, comp.max_abs, comp.worst.flat_index) == (False, 1.0, 1.0, 12345)
    assert grown < 1.5 * n, f"comparing {n} uint8 elements grew the resident peak by {grown / n:.1f} bytes an element"
