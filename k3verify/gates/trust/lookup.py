"""The gate `serve` must pass: a green report.json bound to exactly what is about to be served.

A report counts for a target only if its run record matches: checkpoint digest (every byte, see
checkpoint/digest.py), k3verify version, source digest of the package (gates/core/binding.py), device kind,
the preset (when a preset is served), and its `dtypes` cover the dtype to be served. Only reports recorded in the
report index k3verify writes beside every report count (gates/report/index.py), and the index line, report.json's
`run` and the target are compared field by field: an index line edited to name another checkpoint or wider dtypes
is refused, naming the field. Which report decides: the one whose run started last, a time read from inside the
report (whose bytes the index hashes and the key signs), never the index's editable write time; a newer failing run
shadows an older passing one, and a newer report whose report.json was edited, put back or removed closes the gate
instead of letting an older one decide. The deciding report is re-derived before it is believed
(gates/trust/rederive.py): its summary from its results, every result's status from its metric, bar and control, the
suite's whole check list, its dtypes from the checks that ran; its dates must be neither in the future nor (for a
pass) older than `max_age_s`; its verdict must be "pass". With a report key only reports whose signature and index
line verify are considered. A run narrowed with `--only` is not a gate (it could have selected a single self-test)
and never counts; neither does a `parity --endpoint` run (it judged some other server, not this one's model).
Files outside any index, unreadable indexes and schema-invalid reports are skipped with a warning.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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
    binding_of,
    binding_problem,
    content_problem,
    line_problem,
    read_index,
)
from k3verify.gates.report.json_report import validate_report
from k3verify.gates.trust.rederive import report_problem

log = logging.getLogger(__name__)
DEFAULT_MAX_AGE_DAYS = 30.0
FUTURE_SKEW_S = 300.0  # clocks of the machine that ran parity and of the one that serves may differ by this much
LATEST = datetime.max.replace(tzinfo=UTC)


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
    max_age_s: float = DEFAULT_MAX_AGE_DAYS * 86400  # a pass whose run started longer ago is refused
    now: Callable[[], datetime] = lambda: datetime.now(UTC)


@dataclass(frozen=True)
class GateLookup:
    """What the report dir holds for one target: the deciding report (if any) and why it does or does not pass."""

    passing: Path | None
    newest: Path | None
    reason: str
    skipped: tuple[Path, ...] = ()


def _mismatch(run: Mapping[str, Any], want: GateWant) -> str | None:
    """Which part of a run's binding names something else than what is served (None: it vouches for `want`)."""
    if run.get("narrowed"):
        return "runs narrowed by --only"
    if run.get("endpoint"):
        return "--endpoint runs"
    for key, what in (("checkpoint_digest", "checkpoints"), ("k3verify_version", "k3verify versions"),
                      ("device", "devices"), ("source_digest", "k3verify sources")):
        if run.get(key) != getattr(want, _WANT_FIELD[key]):
            return f"other {what}"
    if want.preset is not None and run.get("preset") != want.preset:
        return "other presets"
    if want.dtype not in (run.get("dtypes") or ()):
        return "other dtypes"
    return None


_WANT_FIELD = {"checkpoint_digest": "digest", "k3verify_version": "version", "device": "device",
               "source_digest": "source_digest"}


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


@dataclass(frozen=True)
class _Candidate:
    """An indexed report that vouches for the target by its index line or by its own run record."""

    entry: IndexEntry
    path: Path
    data: dict[str, Any] | None  # None: unreadable, edited or put back (problem says which)
    problem: str | None

    @property
    def order(self) -> tuple[datetime, int, str]:
        """Newest first by the run's own start (inside the hashed and signed report), never by the index's editable
        write time; a report that cannot be read orders by its index line (it can only close the gate)."""
        when = self.data["run"]["started_at"] if self.data is not None else self.entry.written_at
        return _time(when) or LATEST, self.entry.seq, str(self.path)


def _time(text: object) -> datetime | None:
    """An ISO 8601 time as k3verify writes it (UTC), or None for anything else."""
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def lookup_report(report_dir: str | Path, want: GateWant) -> GateLookup:
    """Search report_dir recursively for indexed reports bound to `want`; the newest by its run's start decides."""
    root = Path(report_dir)
    if not root.is_dir():
        return GateLookup(None, None, f"report dir {root} does not exist")
    skipped: list[Path] = []
    others: Counter[str] = Counter()
    dtypes_seen: set[str] = set()
    matches = []
    for entry, path, entries in _indexed(root, skipped):
        data, problem = _load(path, entries)
        runs = [entry.run] + ([binding_of(data["run"])] if data is not None else [])
        buckets = [_mismatch(run, want) for run in runs]
        if None not in buckets:
            if buckets[0] == "other dtypes":
                dtypes_seen.update(entry.run.get("dtypes") or ())
            others[str(buckets[0])] += 1
            continue
        matches.append(_Candidate(entry, path, data, problem))
    for found in sorted(matches, key=lambda m: m.order, reverse=True):
        entry, path, data = found.entry, found.path, found.data
        if data is None or found.problem is not None:
            return GateLookup(None, path, f"the newest report for this target, {path} (write #{entry.seq} of its "
                                          f"index), cannot be trusted: {found.problem}", tuple(skipped))
        if want.key is not None:
            untrusted = signature_problem(data, want.key) or line_problem(entry, want.key)
            if untrusted is not None:  # not the key holder's: as if it were not there
                _skip(path, untrusted, skipped)
                continue
        return _decide(path, entry, data, want, tuple(skipped))
    return GateLookup(None, None, _no_match(want, others, dtypes_seen, skipped), tuple(skipped))


def _load(path: Path, entries: list[IndexEntry]) -> tuple[dict[str, Any] | None, str | None]:
    """(the report, None) when its bytes are its index's latest write, valid and recorded as its index line says;
    (the report, why not) when the line records another run; (None, why not) when it cannot be used at all."""
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
    return data, binding_problem(entries[-1], data["run"])


def _date_problem(data: Mapping[str, Any], entry: IndexEntry, want: GateWant) -> str | None:
    """A run starts before its report is written, and neither lies in the future: a date that does was edited."""
    started_text, now = data["run"]["started_at"], want.now()
    started, written = _time(started_text), _time(entry.written_at)
    if started is None:
        return f"its run.started_at {started_text!r} is not a time k3verify writes (ISO 8601, UTC)"
    if written is None:
        return f"its index line's written_at {entry.written_at!r} is not a time k3verify writes (ISO 8601, UTC)"
    if started > written:
        return (f"its run.started_at {started_text} is after k3verify wrote it ({entry.written_at}, "
                f"write #{entry.seq} of its index): the date was edited")
    for what, when, text in (("run.started_at", started, started_text), ("index written_at", written,
                                                                         entry.written_at)):
        if when > now + timedelta(seconds=FUTURE_SKEW_S):
            return f"its {what} {text} is in the future (now {now.isoformat(timespec='seconds')}): it was edited"
    return None


def _age_problem(data: Mapping[str, Any], want: GateWant) -> str | None:
    """A pass older than want.max_age_s vouches for code and weights nobody has re-checked since."""
    started = _time(data["run"]["started_at"])
    assert started is not None  # _date_problem refused anything else
    age = want.now() - started
    if age.total_seconds() <= want.max_age_s:
        return None
    return (f"it passed on {data['run']['started_at']}, {age.days} days ago; a pass older than "
            f"{want.max_age_s / 86400:g} days is refused (--max-report-age): run `k3verify parity` again")


def _decide(path: Path, entry: IndexEntry, data: dict[str, Any], want: GateWant,
            skipped: tuple[Path, ...]) -> GateLookup:
    """The deciding report passes only if it is what its own numbers say and that is "pass"."""
    problem = summary_problem(data) or _date_problem(data, entry, want)
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
    stale = _age_problem(data, want)
    if stale is not None:
        return GateLookup(None, path, f"the newest matching report {path} is too old: {stale}", skipped)
    return GateLookup(path, path, f"{path} passed (write #{entry.seq} of its index, {entry.written_at})", skipped)


def find_passing_report(report_dir: str | Path, want: GateWant) -> Path | None:
    """The newest report.json under report_dir bound to `want`, if it passes; else None."""
    return lookup_report(report_dir, want).passing
