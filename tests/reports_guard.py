"""What the test run must leave alone: the checkout's reports/ (tests/conftest.py compares it before and after)."""

from __future__ import annotations

from pathlib import Path

CHECKOUT_REPORTS = Path(__file__).resolve().parent.parent / "reports"


def reports_state(root: Path = CHECKOUT_REPORTS) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under the checkout's reports/: what a user's own runs left there."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}
