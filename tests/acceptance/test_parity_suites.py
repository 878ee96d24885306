"""Acceptance: every documented `k3verify parity` invocation (tests/acceptance/invocations.py, listed in
docs/invocations.md) passes on a healthy target: the README's default command, the full suite on every synthetic
preset it names, the tensor/expert-parallel layouts, both serving dtypes, written checkpoints and our own server
over HTTP. Each run writes a schema-valid report with no fail, vacuous or error, every check that ran has a
control that failed, every skip has a reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from invocations import CELLS, Cell

from k3verify.cli import main
from k3verify.gates.report.json_report import load_report


def _assert_green(report_dir: Path) -> dict:
    data = load_report(report_dir)  # schema-validated
    assert data["summary"]["verdict"] == "pass", data["summary"]
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


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The matrix's placeholders: two presets' checkpoints written to disk, and a report key."""
    root = tmp_path_factory.mktemp("invocations")
    values = {}
    for preset, name in (("k3-tiny", "K3_TINY_DIR"), ("kl-tiny", "KL_TINY_DIR")):
        assert main(["checkpoint", "make", "--preset", preset, str(root / preset)]) == 0
        values[name] = str(root / preset)
    (root / "key").write_text("a-report-key-of-enough-bytes-0123456789\n")
    values["KEY_FILE"] = str(root / "key")
    return values


@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
def test_documented_invocation_is_green(cell: Cell, placeholders: dict[str, str], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The cell's command exits 0 with a green report (a full suite also localizes every model-level check)."""
    argv = [placeholders.get(a, a) for a in cell.argv]
    if cell.lists:
        assert main(["parity", *argv]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert any(line.startswith("dist.greedy\t") for line in lines) and len(lines) > 50
        return
    rc = main(["parity", *argv, "--report-dir", str(tmp_path)])
    data = _assert_green(tmp_path)
    assert rc == 0
    if not cell.argv:
        assert data["run"]["preset"] == "k3-tiny" and data["run"]["suite"] == "quick"
    if "--report-key" in cell.argv:
        assert data["signature"]["alg"] == "hmac-sha256"
    if cell.full_suite:
        model_level = [r for r in data["results"] if r["level"] == "model" and r["status"] == "pass"]
        assert model_level, "every full suite has model-level checks"
        for r in model_level:
            loc = r.get("localization") or {}
            assert loc.get("per_layer"), f"{r['id']}: a model-level check must report error over depth"
