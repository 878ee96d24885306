"""The CPU the host side of a served run had: the CPUs this process may use, the cgroup's CPU quota, and how long
the cgroup was throttled (its quota spent within a scheduler period: every process of it then waits for the next
period, up to 100 ms). A served wave runs the engine, the HTTP server and the client processes at once; a prefill
step is host-bound, so a throttled cgroup shows up as slow prefill steps that no in-process measurement repeats.
cgroup v2 (`cpu.stat` / `cpu.max` under /sys/fs/cgroup) and v1 (`cpu/cpu.stat`, `cpu/cpu.cfs_quota_us`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _fields(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def throttled_ms(root: Path = ROOT) -> float | None:
    """Milliseconds the cgroup has been throttled so far (None: no cgroup CPU statistics here)."""
    v2 = _fields(_read(root / "cpu.stat"))
    if "throttled_usec" in v2:
        return v2["throttled_usec"] / 1e3
    v1 = _fields(_read(root / "cpu" / "cpu.stat"))
    if "throttled_time" in v1:
        return v1["throttled_time"] / 1e6
    return None


def quota_cpus(root: Path = ROOT) -> float | None:
    """The cgroup's CPU quota in CPUs (None: unlimited or unknown)."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period)
    quota_s, period_s = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if quota_s is None or period_s is None or int(quota_s) < 0:
        return None
    return int(quota_s) / int(period_s)


def host_cpu(root: Path = ROOT) -> dict[str, Any]:
    return {"cpus_usable": len(os.sched_getaffinity(0)), "cgroup_quota_cpus": quota_cpus(root)}
