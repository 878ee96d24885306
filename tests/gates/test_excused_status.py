"""A pass with excused rounding near-ties is its own status, "pass, N roundings excused", in report.json, HTML,
JUnit and the console; the verdict counts it as a pass, and the rule `serve` re-applies agrees with it."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from rich.console import Console

from k3verify.gates import CheckContext, Kind, Registry, Trial
from k3verify.gates.core.binding import summary_problem, verdict_from_counts
from k3verify.gates.core.check import Status
from k3verify.gates.core.evaluate import status_of
from k3verify.gates.core.excused import EXCUSED_METRIC
from k3verify.gates.report.console import summary_table
from k3verify.gates.report.json_report import load_report, write_reports
from k3verify.gates.trust.rederive import result_problem
from tests.gates.conftest import RunFactory


def _excused_registry(registry: Registry, excused: float) -> Registry:
    @registry.register_check(id="endpoint.t.excused", component="endpoint", level="serving", kind=Kind.RMS,
                             bar=5e-3, bar_reason="test bar", control="output scaled by 2")
    def excusing(ctx: CheckContext) -> Trial:
        r = torch.randn(8, 16, generator=ctx.generator)
        return Trial(reference=r, candidate=r * (1 + 1e-4), control=r * 2, metrics={EXCUSED_METRIC: excused})
    return registry


def test_the_gate_rule_names_an_excused_pass_and_never_an_excused_failure() -> None:
    assert status_of(True, False, 3) is Status.EXCUSED and status_of(True, False, 0) is Status.PASS
    assert status_of(False, False, 3) is Status.FAIL and status_of(True, True, 3) is Status.VACUOUS
    counts = dict.fromkeys(("pass", "excused", "fail", "vacuous", "error", "skipped"), 0)
    assert verdict_from_counts({**counts, "excused": 1}) == "pass"
    assert verdict_from_counts({**counts, "excused": 1, "fail": 1}) == "fail"


def test_every_format_says_pass_with_n_roundings_excused(registry: Registry, run_checks: RunFactory,
                                                          tmp_path: Path) -> None:
    run = run_checks(list(_excused_registry(registry, 3.0)))
    write_reports(run, tmp_path)
    data = load_report(tmp_path / "report.json")  # validated against the schema
    (result,) = data["results"]
    assert result["status"] == "excused" and result["metrics"][EXCUSED_METRIC] == 3
    # no model-comparing check ran here, so the run is inconclusive, not failed: the excused result counts as run
    assert data["summary"]["counts"]["excused"] == 1 and data["summary"]["verdict"] == "inconclusive"
    assert summary_problem(data) is None
    assert result_problem(result, registry.get("endpoint.t.excused")) is None
    edited = {**result, "status": "pass"}  # a plain pass claimed for an excused result is refused
    assert "makes it 'excused'" in (result_problem(edited, registry.get("endpoint.t.excused")) or "")
    assert "PASS, 3 ROUNDINGS EXCUSED" in (tmp_path / "report.html").read_text()
    cases = ET.parse(tmp_path / "junit.xml").getroot().iter("testcase")
    (case,) = [c for c in cases if c.get("name", "").startswith("endpoint.t.excused")]
    assert case.get("name") == "endpoint.t.excused [pass, 3 roundings excused]"
    assert case.find("failure") is None and case.find("error") is None  # a passing testcase that says so
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(run.results))
    assert "pass, 3 roundings excused" in out.getvalue()


def test_a_pass_with_nothing_excused_stays_a_plain_pass(registry: Registry, run_checks: RunFactory) -> None:
    (result,) = run_checks(list(_excused_registry(registry, 0.0))).results
    assert result.status is Status.PASS
