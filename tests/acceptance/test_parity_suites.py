"""Acceptance: the parity command itself, end to end, on every synthetic preset.

`k3verify parity` (defaults: k3-tiny, quick, cpu) must exit 0 and write a schema-valid report, and the
full suite must be green on k3-tiny, k3-syn-25, k3-skew-10 and kl-tiny — every check with a control
that failed, none vacuous, none erroring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3verify.cli import main
from k3verify.gates.report import load_report


def _assert_green(report_dir: Path) -> dict:
    data = load_report(report_dir)  # schema-validated
    assert data["summary"]["verdict"] == "pass"
    counts = data["summary"]["counts"]
    assert counts["fail"] == counts["vacuous"] == counts["error"] == 0
    ran = [r for r in data["results"] if r["status"] == "pass"]
    assert ran, "a green run must have run something"
    for r in ran:
        assert r["control"]["status"] == "fail", f"{r['id']}: its control did not fail"
    for r in data["results"]:
        if r["status"] == "skipped":
            assert r.get("reason"), f"{r['id']} skipped without a reason"
    for name in ("report.json", "report.html", "junit.xml"):
        assert (report_dir / name).stat().st_size > 0
    return data


def test_default_parity_command_is_green(tmp_path: Path) -> None:
    """`k3verify parity` with only a report dir: k3-tiny, quick suite, cpu."""
    assert main(["parity", "--report-dir", str(tmp_path)]) == 0
    data = _assert_green(tmp_path)
    assert data["run"]["preset"] == "k3-tiny" and data["run"]["suite"] == "quick"
    assert json.loads((tmp_path / "report.json").read_text())["schema_version"]


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-syn-25", "k3-skew-10", "kl-tiny"])
def test_full_suite_is_green(preset: str, tmp_path: Path) -> None:
    assert main(["parity", "--preset", preset, "--suite", "full", "--report-dir", str(tmp_path)]) == 0
    data = _assert_green(tmp_path)
    model_level = [r for r in data["results"] if r["level"] == "model" and r["status"] == "pass"]
    assert model_level, "every full suite has model-level checks"
    for r in model_level:
        loc = r.get("localization") or {}
        assert loc.get("per_layer"), f"{r['id']}: a model-level check must report error over depth"
