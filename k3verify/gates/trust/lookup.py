"""The gate `serve` must pass: a green report.json bound to exactly what is about to be served.

A report counts for a target only if its run record matches: checkpoint digest (every byte, see
checkpoint/digest.py), k3verify version, source digest of the package (gates/core/binding.py), device kind,
the preset (when a preset is served), and its `dtypes` cover the dtype to be served. Which report decides comes
from the report index k3verify writes beside every report (gates/report/index.py), never from a report's own date:
the newest matching entry decides, so a newer failing run shadows an older passing one, and a newer entry whose
report.json was edited, put back or removed closes the gate instead of letting an older one decide. The deciding
report must be byte for byte what the index recorded, and is re-derived before it is believed (gates/trust/rederive.py):
its summary from its results, every result's status from its metric, bar and control, the suite's whole check
list, its dtypes from the checks that ran; its verdict must be "pass". With a report key only reports whose
signature verifies are considered. A run narrowed with `--only` is not a gate (it could have selected a single
self-test) and never counts; neither does a `parity --endpoint` run (it judged some other server, not this one's
model). Files outside any index, unreadable indexes and schema-invalid reports are skipped with a warning.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from k3verify.gates.core.binding import recompute_summary, signature_problem, summary_problem
from k3verify.gates.core.check import Check
from k3verify.gates.core.suite import check_import_errors, gate_checks, load_all_checks
from k3verify.gates.report.index import (
    INDEX_FILE,
    REPORT_FILE,
    IndexEntry,
    ReportIndexError,
    content_problem,
    read_index,
)
from k3verify.gates.report.json_report import validate_report
from k3verify.gates.trust.rederive import report_problem

log = logging.getLogger(__name__)


class GateCheckError(RuntimeError):
    """The checks a gating report must hold cannot be listed (a check module failed to import)."""


def registered_checks() -> list[Check]:
    """Every check of this k3verify (what a report's results are judged by); GateCheckError if a module is missing."""
    checks = load_all_checks()
    broken = check_import_errors()
    if broken:
        raise GateCheckError(f"check module(s) {', '.join(sorted(broken))} failed to import, so the checks a report "
                             "must hold are not known")
    return checks


@dataclass(frozen=True)
class GateWant:
    """What is about to be served, as a report's run record must name it."""

    digest: str
    version: str
    device: str  # device kind: "cpu" | "cuda"
    dtype: str  # "bfloat16" | "float32"
    source_digest: str
    preset: str | None = None  # checked when a preset is served (a checkpoint dir is bound by its digest)
    key: bytes | None = None  # with a key, unsigned or wrongly signed reports do not count
    checks: Callable[[], Sequence[Check]] = registered_checks  # the registry a report is judged against


@dataclass(frozen=True)
class GateLookup:
    """What the report dir holds for one target: the deciding report (if any) and why it does or does not pass."""

    passing: Path | None
    newest: Path | None
    reason: str
    skipped: tuple[Path, ...] = ()


def _mismatch(run: Mapping[str, Any], want: GateWant) -> str | None:
    """Which part of the run record names something else than what is served (None: all match but dtype)."""
    if run["checkpoint_digest"] != want.digest:
        return "other checkpoints"
    if run["k3verify_version"] != want.version:
        return "other k3verify versions"
    if run["device"] != want.device:
        return "other devices"
    if run["source_digest"] != want.source_digest:
        return "other k3verify sources"
    if want.preset is not None and run["preset"] != want.preset:
        return "other presets"
    return None


def _no_match(want: GateWant, others: Counter[str], dtypes_seen: set[str], skipped: list[Path]) -> str:
    why = f"no report for checkpoint {want.digest} with k3verify {want.version} on {want.device}"
    if dtypes_seen:
        why = (f"no report for checkpoint {want.digest} covers dtype {want.dtype}: the matching reports cover "
               f"{', '.join(sorted(dtypes_seen))} only (run `k3verify parity --dtype {want.dtype}`)")
    detail = ", ".join(f"{n} report(s) for {what}" for what, n in sorted(others.items()))
    if skipped:
        detail += f"{', ' if detail else ''}{len(skipped)} invalid or untrusted file(s) ignored"
    return why + (f" ({detail})" if detail else "")


def _skip(path: Path, why: str, skipped: list[Path]) -> None:
    log.warning("ignoring gate report %s: %s", path, why)
    skipped.append(path)


def _indexed(root: Path, skipped: list[Path]) -> list[tuple[IndexEntry, Path, list[IndexEntry]]]:
    """(latest entry, its report.json, every entry) of each readable index under root; report.json files outside
    any index and unreadable indexes are skipped."""
    dirs = sorted({p.parent for p in root.rglob(INDEX_FILE)})
    for report in sorted(root.rglob(REPORT_FILE)):
        if report.parent not in dirs:
            _skip(report, f"no {INDEX_FILE} beside it (k3verify writes one with every report; this file was not "
                          "written by this k3verify's parity)", skipped)
    out = []
    for directory in dirs:
        try:
            entries = read_index(directory)
        except (ReportIndexError, OSError) as exc:
            _skip(directory / INDEX_FILE, str(exc), skipped)
            continue
        out.append((entries[-1], directory / REPORT_FILE, entries))
    return out


def lookup_report(report_dir: str | Path, want: GateWant) -> GateLookup:
    """Search report_dir recursively for indexed reports bound to `want`; the newest by the index decides."""
    root = Path(report_dir)
    if not root.is_dir():
        return GateLookup(None, None, f"report dir {root} does not exist")
    skipped: list[Path] = []
    others: Counter[str] = Counter()
    dtypes_seen: set[str] = set()
    matches = []
    for entry, path, entries in _indexed(root, skipped):
        run = entry.run
        narrowed = "runs narrowed by --only" if run.get("narrowed") else "--endpoint runs" if run.get("endpoint") \
            else None
        mismatch = narrowed or _mismatch(run, want)
        if mismatch is None and want.dtype not in (run.get("dtypes") or ()):
            dtypes_seen.update(run.get("dtypes") or ())
            mismatch = "other dtypes"
        if mismatch is not None:
            others[mismatch] += 1
            continue
        matches.append((entry, path, entries))
    if not matches:
        return GateLookup(None, None, _no_match(want, others, dtypes_seen, skipped), tuple(skipped))
    for entry, path, entries in sorted(matches, key=lambda m: (m[0].order, str(m[1])), reverse=True):
        data, problem = _load(path, entries)
        if data is not None and want.key is not None:
            untrusted = signature_problem(data, want.key)
            if untrusted is not None:  # not the key holder's: as if it were not there
                _skip(path, untrusted, skipped)
                continue
        if data is None:
            return GateLookup(None, path, f"the newest report for this target, {path} (write #{entry.seq} of its "
                                          f"index), cannot be trusted: {problem}", tuple(skipped))
        return _decide(path, entry, data, want, tuple(skipped))
    return GateLookup(None, None, _no_match(want, others, dtypes_seen, skipped), tuple(skipped))


def _load(path: Path, entries: list[IndexEntry]) -> tuple[dict[str, Any] | None, str]:
    """(the report, "") when its bytes are its index's latest write and valid; else (None, why not)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror or exc}) though its index records it"
    problem = content_problem(raw, entries)
    if problem is not None:
        return None, problem
    try:
        data = json.loads(raw)
        validate_report(data)
    except Exception as exc:  # written by k3verify yet invalid: another version's schema, say
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return data, ""


def _date_problem(data: Mapping[str, Any], entry: IndexEntry) -> str | None:
    """A run starts before its report is written: a started_at after the index's write time was edited."""
    try:
        started = datetime.fromisoformat(data["run"]["started_at"])
        written = datetime.fromisoformat(entry.written_at)
        later = started > written
    except (ValueError, TypeError) as exc:
        return f"its run.started_at {data['run']['started_at']!r} is not a time k3verify writes ({exc})"
    if later:
        return (f"its run.started_at {data['run']['started_at']} is after k3verify wrote it ({entry.written_at}, "
                f"write #{entry.seq} of its index): the date was edited")
    return None


def _decide(path: Path, entry: IndexEntry, data: dict[str, Any], want: GateWant,
            skipped: tuple[Path, ...]) -> GateLookup:
    """The deciding report passes only if it is what its own numbers say and that is "pass"."""
    problem = summary_problem(data) or _date_problem(data, entry)
    if problem is None:
        try:
            registered = list(want.checks())
        except GateCheckError as exc:
            return GateLookup(None, path, f"cannot judge {path}: {exc}", skipped)
        expected = [c.id for c in gate_checks(registered, data["run"]["suite"])]
        problem = report_problem(data, {c.id: c for c in registered}, expected)
    if problem is not None:
        return GateLookup(None, path, f"the newest matching report {path} cannot be trusted: {problem}", skipped)
    summary = recompute_summary(data)
    if summary["verdict"] != "pass":
        c = summary["counts"]
        why = (f"the newest matching report {path} has verdict {summary['verdict']!r} "
               f"({c['fail']} fail, {c['vacuous']} vacuous, {c['error']} error)")
        if "setup_error" in summary:
            why += f": {summary['setup_error']}"
        return GateLookup(None, path, why, skipped)
    return GateLookup(path, path, f"{path} passed (write #{entry.seq} of its index, {entry.written_at})", skipped)


def find_passing_report(report_dir: str | Path, want: GateWant) -> Path | None:
    """The newest report.json under report_dir bound to `want`, if it passes; else None."""
    return lookup_report(report_dir, want).passing
