"""The process's resident host memory on Linux: its peak since the last reset (VmHWM) and the reset itself.

A real-size check can fill the host (128 GiB on the lent GPU machines) long before the card, and the kernel's
out-of-memory killer ends the process without a word; the per-check host peak says which check grew it. Elsewhere
(no /proc) both functions answer None and the metric is not recorded.
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_host_peak() -> bool:
    """Start a new peak at the current resident size (Linux: write 5 to clear_refs); False where it cannot."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def host_peak_bytes() -> int | None:
    """The resident peak (VmHWM) since the process started or the last reset, or None where unknown."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
