"""The quantization report's plots take the values a report holds once read back from disk: report.json stores a
non-finite number as "nan" / "inf", and a KL over a row with no listed tokens is NaN."""

from __future__ import annotations

from k3verify.peers.quant_report import _bars


def test_non_finite_and_string_values_are_gaps_and_counted() -> None:
    svg = _bars("KL divergence by position", ["0", "1", "2", "3", "4"],
                {"quantization": [0.5, "nan", 0.25, None, "inf"], "server": [1e-3, 2e-3, float("nan"), 4e-3, 5e-3]},
                "nats")
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
    assert "log scale: 0.001 .. 0.5; 4 not finite, left out" in svg
    quantization = svg.split('points="')[1].split('"')[0]
    assert len(quantization.split()) == 2  # 0.5 and 0.25: the rest are gaps


def test_a_series_of_nothing_finite_has_no_data() -> None:
    assert _bars("KL", ["0", "1"], {"a": ["nan", None]}, "nats") == "<p>KL: no data</p>"
