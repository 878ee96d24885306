"""report.json against its schema, atomic writes, JUnit counts, loading, signing, and the lookup `serve` uses."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from k3verify.gates import Registry
from k3verify.gates.core.binding import signature_problem
from k3verify.gates.core.suite import RunResult, collect_run_info
from k3verify.gates.report.json_report import (
    atomic_write_text,
    load_report,
    report_dict,
    write_reports,
)
from k3verify.gates.trust.lookup import GateWant, lookup_report

RunFactory = Callable[..., RunResult]  # the run_checks fixture (conftest.py)
ROOT = Path(__file__).resolve().parents[2]
MUTATIONS = [
    {"id": "kda.conv.no_reset", "target": "serving.layers.kda.short_conv", "fault": "conv window not reset",
     "status": "killed", "killers": ["kda.t.pass"], "expected_killers": ["kda.t.pass", "mla.t.fail"]},
    {"id": "mla.rope.off_by_one", "target": "serving.layers.mla.rope", "fault": "rope position off by one",
     "status": "survived", "killers": [], "expected_killers": ["mla.t.fail"]},
]


@pytest.fixture
def mixed_run(mixed_registry: Registry, run_checks: RunFactory) -> RunResult:
    run = run_checks(list(mixed_registry))
    run.mutations = [dict(m) for m in MUTATIONS]
    return run


def test_package_schema_and_reports_schema_are_identical() -> None:
    package = (ROOT / "k3verify" / "gates" / "report" / "schema.json").read_bytes()
    assert package == (ROOT / "reports" / "schema.json").read_bytes()
    jsonschema.Draft202012Validator.check_schema(json.loads(package))


def test_report_json_validates_and_keeps_every_status(mixed_run: RunResult, tmp_path: Path) -> None:
    write_reports(mixed_run, tmp_path)
    data = load_report(tmp_path / "report.json")
    assert data["schema_version"] == 1
    assert data["summary"]["counts"] == {"pass": 1, "excused": 0, "fail": 1, "vacuous": 1, "error": 1, "skipped": 1}
    assert data["summary"]["verdict"] == "fail" and data["summary"]["total"] == 5
    assert data["summary"]["mutation_counts"] == {"killed": 1, "survived": 1, "error": 0, "equivalent": 0}
    failing = next(r for r in data["results"] if r["id"] == "mla.t.fail")
    assert failing["worst"]["index"] == [3, 5] and failing["control"]["status"] == "fail"


def test_non_finite_metrics_are_stored_as_strings(mixed_run: RunResult) -> None:
    mixed_run.results[0].metrics["nan_metric"] = float("nan")
    mixed_run.results[0].metrics["inf_metric"] = float("-inf")
    data = report_dict(mixed_run)
    metrics = data["results"][0]["metrics"]
    assert (metrics["nan_metric"], metrics["inf_metric"]) == ("nan", "-inf")
    json.dumps(data, allow_nan=False)


def test_load_report_rejects_a_report_that_breaks_the_schema(mixed_run: RunResult, tmp_path: Path) -> None:
    write_reports(mixed_run, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    data["results"][0]["status"] = "probably-fine"
    (tmp_path / "report.json").write_text(json.dumps(data))
    with pytest.raises(jsonschema.ValidationError, match="probably-fine"):
        load_report(tmp_path)


def test_invalid_report_is_not_written(mixed_run: RunResult, tmp_path: Path) -> None:
    mixed_run.run.suite = "nightly"  # not in the schema's enum
    with pytest.raises(jsonschema.ValidationError):
        write_reports(mixed_run, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_crash_mid_write_leaves_old_report_intact_and_no_partial_file(
    mixed_run: RunResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_reports(mixed_run, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    mixed_run.run.seed = 99  # a different report that must not land

    def crash(src: str, dst: str) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        write_reports(mixed_run, tmp_path)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert load_report(tmp_path)["run"]["seed"] == 0


def test_atomic_write_creates_readable_file(tmp_path: Path) -> None:
    path = atomic_write_text(tmp_path / "sub" / "x.txt", "hello")
    assert path.read_text() == "hello" and oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir()] == ["x.txt"]


def test_junit_parses_and_counts_match(mixed_run: RunResult, tmp_path: Path) -> None:
    write_reports(mixed_run, tmp_path)
    root = ET.parse(tmp_path / "junit.xml").getroot()
    checks, mutants = root.findall("testsuite")
    cases = {c.get("name"): c for c in checks.findall("testcase")}
    assert len(cases) == 5 == int(checks.get("tests", "0"))
    assert (checks.get("failures"), checks.get("errors"), checks.get("skipped")) == ("2", "1", "1")
    assert cases["mla.t.fail"].find("failure").get("type") == "fail"  # type: ignore[union-attr]
    assert cases["moe.t.vacuous"].find("failure").get("type") == "vacuous"  # type: ignore[union-attr]
    assert "router exploded" in (cases["router.t.error"].find("error").text or "")  # type: ignore[union-attr]
    assert cases["norm.t.skipped"].find("skipped") is not None
    assert cases["kda.t.pass"].find("failure") is None and cases["kda.t.pass"].find("error") is None
    assert mutants.get("failures") == "1" and len(mutants.findall("testcase")) == 2


def _report_at(run: RunResult, root: Path, name: str, started: str, **run_fields: object) -> None:
    """A report as a bf16 parity run writes it: these model-free runs build no served model, so their first check
    is made to have built it in bfloat16 (`serve` recomputes run.dtypes from the checks)."""
    run_fields.setdefault("dtypes", ["bfloat16"])
    info = dataclasses.replace(run.run, started_at=started, **run_fields)  # type: ignore[arg-type]
    results = [dataclasses.replace(r, serving_dtypes=["bfloat16"] if i == 0 else []) for i, r in enumerate(run.results)]
    write_reports(RunResult(info, results), root / name)


def test_serve_lookup_on_real_reports(mixed_registry: Registry, run_checks: RunFactory, tmp_path: Path) -> None:
    """report_lookup over reports written by write_reports: identity match, newest decides, a failing run shadows."""
    passing = mixed_registry.get("kda.t.pass")
    failing = dataclasses.replace(mixed_registry.get("mla.t.fail"), suites=("full",))  # judged, not required
    green = run_checks([passing])
    red = run_checks([passing, failing])
    want = GateWant(str(green.run.checkpoint_digest), green.run.k3verify_version, "cpu", "bfloat16",
                    green.run.source_digest, "test", checks=lambda: [passing, failing], max_age_s=math.inf)
    _report_at(green, tmp_path, "a", "2026-01-01T00:00:00+00:00")
    _report_at(green, tmp_path, "other-ckpt", "2026-01-05T00:00:00+00:00", checkpoint_digest="sha256:other")
    _report_at(green, tmp_path, "other-device", "2026-01-05T00:00:00+00:00", device="cuda")
    _report_at(green, tmp_path, "old-version", "2026-01-05T00:00:00+00:00", k3verify_version="0.0.1")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "report.json").write_text("{not json")
    found = lookup_report(tmp_path, want)
    assert found.passing == tmp_path / "a" / "report.json" and found.skipped == (tmp_path / "junk" / "report.json",)
    _report_at(red, tmp_path, "b", "2026-01-02T00:00:00+00:00")
    found = lookup_report(tmp_path, want)
    assert found.passing is None and found.newest == tmp_path / "b" / "report.json" and "'fail'" in found.reason
    assert lookup_report(tmp_path / "missing", want).passing is None


def test_signed_reports_verify_after_the_round_trip(mixed_registry: Registry, run_checks: RunFactory,
                                                    tmp_path: Path) -> None:
    """write_reports(key=...) signs report.json; reading it back verifies; flipping one status breaks it."""
    key = b"k" * 32
    green = run_checks([mixed_registry.get("kda.t.pass")])
    write_reports(green, tmp_path, key=key)
    data = load_report(tmp_path)
    assert data["signature"]["alg"] == "hmac-sha256" and signature_problem(data, key) is None
    data["results"][0]["status"] = "fail"
    assert "edited after signing" in str(signature_problem(data, key))
    assert "signed with key" in str(signature_problem(load_report(tmp_path), b"o" * 32))


def test_setup_error_run_has_verdict_error(tmp_path: Path) -> None:
    """A run that never reached its checks is written with verdict "error" and the reason."""
    info = collect_run_info(device="cpu", seed=0, suite="quick")
    write_reports(RunResult(info, [], setup_error="/x/model.safetensors: missing"), tmp_path)
    summary = load_report(tmp_path)["summary"]
    assert summary["verdict"] == "error" and summary["setup_error"] == "/x/model.safetensors: missing"
    assert 'class="verdict error"' in (tmp_path / "report.html").read_text()
