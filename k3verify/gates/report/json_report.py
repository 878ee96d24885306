"""report.json (validated against schema.json before it is written, optionally signed, recorded in the report
index beside it: gates/report/index.py), atomic writes and loading (`serve`'s lookup is gates/trust/lookup.py).

Every file is written to a temporary name in the destination directory, fsynced, then os.replace'd:
a crash mid-write leaves the previous report intact and no partial file behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from k3verify.gates.core.binding import sign_report
from k3verify.gates.core.check import Result
from k3verify.gates.core.suite import RunResult, status_counts
from k3verify.gates.report.html import render_html
from k3verify.gates.report.index import append_entry
from k3verify.gates.report.junit import render_junit

SCHEMA_VERSION = 1
MUTATION_STATUSES = ("killed", "survived", "error", "equivalent")


@cache
def load_schema() -> dict[str, Any]:
    return json.loads(resources.files("k3verify.gates.report").joinpath("schema.json").read_text(encoding="utf-8"))


def _json_safe(value: Any) -> Any:
    """JSON has no NaN/Inf: store them as strings the schema allows; tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def result_to_dict(result: Result) -> dict[str, Any]:
    """One Result as it appears in report.json["results"] (before NaN/Inf become strings)."""
    out: dict[str, Any] = {
        "id": result.id, "component": result.component, "level": result.level, "kind": result.kind,
        "bar": result.bar, "bar_reason": result.bar_reason, "bar_source": result.bar_source,
        "noise": None if result.noise is None else dict(result.noise), "status": result.status.value,
        "reason": result.reason, "metric": result.metric, "metrics": dict(result.metrics),
        "per_key": result.per_key, "margin": result.margin, "thin": result.thin,
        "control": None if result.control is None else asdict(result.control),
        "worst": None, "shapes": result.shapes, "dtypes": result.dtypes,
        "seed": result.seed, "duration_s": result.duration_s, "localization": result.localization,
        "instrument": result.instrument, "notes": list(result.notes), "traceback": result.traceback,
        "serving_dtypes": list(result.serving_dtypes),
    }
    if result.worst is not None:
        out["worst"] = asdict(result.worst) | {"index": list(result.worst.index)}
    return out


def report_dict(run: RunResult) -> dict[str, Any]:
    """The report as plain data (schema_version 1). Validated, never written, by this function."""
    counts = status_counts(run.results)
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "run": asdict(run.run),
        "results": [result_to_dict(r) for r in run.results],
        "summary": {"counts": counts, "total": len(run.results), "verdict": run.verdict},
    }
    if run.setup_error is not None:
        out["summary"]["setup_error"] = run.setup_error
    if run.missing_evidence:
        out["summary"]["missing_evidence"] = run.missing_evidence
    if run.mutations:
        out["mutations"] = [dict(m) for m in run.mutations]
        out["summary"]["mutation_counts"] = {s: sum(m.get("status") == s for m in run.mutations)
                                             for s in MUTATION_STATUSES}
    out = _json_safe(out)
    validate_report(out)
    return out


def validate_report(data: Mapping[str, Any]) -> None:
    """Raise jsonschema.ValidationError naming the first offending path."""
    jsonschema.Draft202012Validator(load_schema()).validate(data)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically: temp file in the same directory, fsync, os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a report is meant to be read by CI and colleagues
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename itself is durable only once the directory entry is synced.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def writable_dir_problem(directory: str | Path) -> str | None:
    """Why reports cannot be written into `directory` (created if missing), or None: found before a suite runs,
    not after it."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".k3v-write-probe.", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write reports into {directory}: {exc.strerror or exc}"
    return None


def write_reports(run: RunResult, out_dir: str | Path, *, key: bytes | None = None) -> dict[str, Path]:
    """Write report.json, report.html and junit.xml into out_dir. The JSON is validated first, so a
    report that does not match the schema leaves the previous files untouched; with `key` it is signed
    (gates/core/binding.py)."""
    return write_report_data(report_dict(run), out_dir, key=key)


def write_report_data(data: dict[str, Any], out_dir: str | Path, *, key: bytes | None = None) -> dict[str, Path]:
    """write_reports for a report already in plain data and validated (report_dict, or a merged one:
    gates/report/merge.py): signed with `key` (and validated again), written atomically and indexed."""
    out_dir = Path(out_dir)
    if key is not None:
        data = sign_report(data, key)
        validate_report(data)
    texts = {
        "report.json": json.dumps(data, indent=2, allow_nan=False) + "\n",
        "report.html": render_html(data),
        "junit.xml": render_junit(data),
    }
    written = {name: atomic_write_text(out_dir / name, text) for name, text in texts.items()}
    append_entry(out_dir, texts["report.json"].encode("utf-8"), data["run"], key)  # what `serve` binds reports by
    return written


def load_report(path: str | Path) -> dict[str, Any]:
    """Read and validate a report.json (a directory means its report.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    validate_report(data)
    return data
