"""report.html renders in a real headless browser (Chromium) and is self-contained."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from k3verify.gates import Registry, load_all_checks, select_checks
from k3verify.gates.core.suite import RunResult
from k3verify.gates.report.json_report import write_reports
from tools.screenshot_report import find_browser

RunFactory = Callable[..., RunResult]  # the run_checks fixture (conftest.py)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "screenshot_report.py"


def _screenshot(html: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    if find_browser() is None:
        print("SKIP reason: chromium is not installed (apt-get install -y chromium)")
        pytest.skip("chromium is not installed (Debian package `chromium`)")
    png, dom = tmp_path / "shot.png", tmp_path / "dom.html"
    done = subprocess.run([sys.executable, str(SCRIPT), str(html), str(png), "--dom-out", str(dom)],
                          capture_output=True, text=True, timeout=240)
    return done, png, dom


def test_failing_report_renders_with_fail_banner(mixed_registry: Registry, run_checks: RunFactory,
                                                 tmp_path: Path) -> None:
    run = run_checks([*select_checks(load_all_checks(), "quick", ["gates.selftest"]), *mixed_registry])
    paths = write_reports(run, tmp_path / "rep")
    done, png, dom = _screenshot(paths["report.html"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = dom.read_text()
    assert re.search(r'id="verdict"[^>]*>\s*<span class="word">FAIL</span>', text)
    assert "gates.selftest.layer_stack" in text and "<polyline" in text


def test_passing_report_renders_with_pass_banner(run_checks: RunFactory, tmp_path: Path) -> None:
    paths = write_reports(run_checks(select_checks(load_all_checks(), "quick", ["gates.selftest"])), tmp_path / "rep")
    done, png, dom = _screenshot(paths["report.html"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert png.stat().st_size > 0 and '<span class="word">PASS</span>' in dom.read_text()


def test_screenshot_script_fails_when_the_verdict_is_missing(tmp_path: Path) -> None:
    page = tmp_path / "blank.html"
    page.write_text("<!doctype html><html><body><p>no verdict here</p></body></html>")
    done, _, _ = _screenshot(page, tmp_path)
    assert done.returncode == 1 and "verdict banner not found" in done.stderr


def test_html_is_self_contained(mixed_registry: Registry, run_checks: RunFactory, tmp_path: Path) -> None:
    """No scripts and no network references: it must render from a file on an air-gapped machine."""
    html = write_reports(run_checks(list(mixed_registry)), tmp_path)["report.html"].read_text()
    assert "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "url(" not in html
