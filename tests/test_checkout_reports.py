"""The guard that keeps the test run out of the checkout's reports/ (tests/conftest.py) sees what a run leaves."""

from __future__ import annotations

from pathlib import Path

from reports_guard import reports_state


def test_reports_state_sees_a_report_written_replaced_or_removed(tmp_path: Path) -> None:
    """A report.json written, rewritten with other bytes, or removed changes the state the guard compares."""
    root = tmp_path / "reports"
    empty = reports_state(root)
    (root / "latest").mkdir(parents=True)
    (root / "latest" / "report.json").write_text('{"verdict": "pass"}')
    written = reports_state(root)
    assert written != empty and "latest/report.json" in written
    (root / "latest" / "report.json").write_text('{"verdict": "error", "only": ["x"]}')
    assert reports_state(root) != written
    (root / "latest" / "report.json").unlink()
    assert "latest/report.json" not in reports_state(root)
