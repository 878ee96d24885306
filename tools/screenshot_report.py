#!/usr/bin/env python3
"""Render a report.html in headless Chromium: write a PNG screenshot and the rendered DOM, and exit
non-zero unless the DOM's verdict banner says PASS or FAIL (proof the page renders without scripts
or network, not just that the file exists).

    python tools/screenshot_report.py reports/latest/report.html /tmp/report.png [--dom-out DOM.html]

Needs the Debian package `chromium` (apt-get install -y chromium).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# The banner is <header id="verdict" ...><span class="word">PASS</span>...; match it in the rendered DOM.
VERDICT_RE = re.compile(r'id="verdict"[^>]*>\s*<span class="word">(PASS|FAIL)</span>')


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium(browser: str, profile: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: CI runs as root in a container, where Chromium's sandbox cannot start.
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", f"--user-data-dir={profile}"]
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report_html", type=Path)
    parser.add_argument("out_png", type=Path)
    parser.add_argument("--dom-out", type=Path, help="also write the rendered DOM here")
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args(argv)

    browser = find_browser()
    if browser is None:
        print(f"screenshot_report: no headless browser found (tried {', '.join(BROWSERS)}); "
              "install the Debian package `chromium`", file=sys.stderr)
        return 3
    if not args.report_html.is_file():
        print(f"screenshot_report: {args.report_html} is not a file", file=sys.stderr)
        return 2
    url = args.report_html.resolve().as_uri()
    args.out_png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="k3v-chromium-") as profile:
        shot = _chromium(browser, profile, f"--screenshot={args.out_png.resolve()}", "--window-size=1280,2000",
                         url, timeout=args.timeout)
        dom = _chromium(browser, profile, "--dump-dom", url, timeout=args.timeout)
    if shot.returncode != 0 or not args.out_png.is_file() or args.out_png.stat().st_size == 0:
        print(f"screenshot_report: screenshot failed (exit {shot.returncode}):\n{shot.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    if args.dom_out is not None:
        args.dom_out.write_text(dom.stdout, encoding="utf-8")
    match = VERDICT_RE.search(dom.stdout)
    if dom.returncode != 0 or match is None:
        print(f"screenshot_report: verdict banner not found in the rendered DOM (exit {dom.returncode}):\n"
              f"{dom.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"{match.group(1)} {args.out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
