"""Schema-valid gate reports built from the real check registry (every check of the quick suite, with numbers that
decide each status), written the way `parity` writes them: report.json plus a line in the report index."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import k3verify
from k3verify.gates.core.binding import source_digest
from k3verify.gates.core.check import Check
from k3verify.gates.core.compare import BF16_MAX_FAIL_FRACTION, Kind
from k3verify.gates.core.noise import derive_bar
from k3verify.gates.core.suite import gate_checks
from k3verify.gates.report.index import append_entry
from k3verify.gates.report.json_report import validate_report
from k3verify.gates.trust.lookup import registered_checks

NOISE = {"value": 1e-6, "dtype": "float32"}  # a recorded noise a noise-barred check's bar derives from


@cache
def quick_checks() -> tuple[Check, ...]:
    return tuple(gate_checks(registered_checks(), "quick"))


def bar_of(check: Check) -> float | None:
    if check.kind is Kind.BITEXACT:
        return None
    if check.kind is Kind.BF16:
        return BF16_MAX_FAIL_FRACTION
    return derive_bar(NOISE["value"], NOISE["dtype"])[0] if check.noise is not None else check.bar


def result(check: Check, status: str, serving_dtypes: list[str] | None = None) -> dict[str, Any]:
    """One result entry of `check` whose metric, bar and control decide `status` (pass, fail or skipped)."""
    ran = status != "skipped"
    noise = None
    if ran and check.noise is not None:
        noise = {**NOISE, "source": "recorded", "pair": check.noise, "factor": 4.0, "floor": None, "derivation": "x",
                 "observed": None, "why_measured": None, "note": None}
    return {"id": check.id, "component": check.component, "level": check.level, "kind": check.kind.value,
            "bar": bar_of(check), "bar_reason": check.bar_reason,
            "bar_source": "noise" if check.noise is not None else check.bar_source, "noise": noise,
            "status": status, "reason": None, "metric": (0.0 if status == "pass" else "inf") if ran else None,
            "metrics": {}, "per_key": {}, "margin": None, "thin": False,
            "control": {"status": "fail", "description": check.control, "metric": "inf", "metrics": {},
                        "reason": "x", "first_divergent_layer": None} if ran else None,
            "worst": None, "shapes": {}, "dtypes": {}, "seed": 0, "duration_s": 0.1, "localization": None,
            "instrument": None, "notes": [], "traceback": None, "serving_dtypes": serving_dtypes or []}


def ago(seconds: float) -> str:
    """A run's started_at `seconds` before now, as parity writes it."""
    return (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat(timespec="microseconds")


def report_data(*, digest: str, version: str = k3verify.__version__, device: str = "cpu", verdict: str = "pass",
                started_at: str | None = None, only: list[str] | None = None,
                preset: str = "k3-tiny", dtypes: list[str] | None = None, source: str | None = None) -> dict[str, Any]:
    """A quick-suite report of every check (the last skipped, one failing when verdict is "fail"), validated against
    the schema, whose summary and dtypes are what its results imply."""
    dtypes = ["bfloat16", "float32"] if dtypes is None else dtypes
    checks = quick_checks()
    statuses = ["pass"] * (len(checks) - 1) + ["skipped"]
    if verdict == "fail":
        statuses[0] = "fail"
    results = [result(c, st, dtypes if i == 1 else None)
               for i, (c, st) in enumerate(zip(checks, statuses, strict=True))]
    counts = {st: statuses.count(st) for st in ("pass", "fail", "vacuous", "error", "skipped")}
    data = {
        "schema_version": 1,
        "run": {"k3verify_version": version, "git_sha": "unknown", "git_dirty": None, "python": "3.11",
                "torch": "2.13", "transformers": None, "fla": None, "device": device, "device_name": "cpu",
                "preset": preset, "checkpoint": None, "checkpoint_digest": digest, "seed": 0, "suite": "quick",
                "only": only or [], "started_at": started_at or ago(60), "wall_time_s": 1.0, "oracle": {},
                "environment": {},
                "dtypes": dtypes, "source_digest": source or source_digest()},
        "results": results,
        "summary": {"counts": counts, "total": len(results), "verdict": verdict},
    }
    validate_report(data)
    return data


def write_report(directory: Path, *, data: dict[str, Any] | None = None, key: bytes | None = None, **kw: Any) -> Path:
    """report_data(**kw) (or `data` as given) written as directory/report.json and recorded in its index (the line
    signed with `key` when given), as `parity` writes a report."""
    directory.mkdir(parents=True, exist_ok=True)
    data = data if data is not None else report_data(**kw)
    text = json.dumps(data)
    path = directory / "report.json"
    path.write_text(text, encoding="utf-8")
    append_entry(directory, text.encode("utf-8"), data["run"], key)
    return path


def edit_report(path: Path, data: dict[str, Any]) -> None:
    """Overwrite report.json as an editor would: the index is left as k3verify wrote it."""
    path.write_text(json.dumps(data), encoding="utf-8")
