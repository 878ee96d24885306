"""The gate `serve` must pass: a green report.json bound to exactly what is about to be served.

A report counts for a target only if its run record matches: checkpoint digest (every byte, see
checkpoint/digest.py), k3verify version, source digest of the package (gates/binding.py), device kind,
the preset (when a preset is served), and its `dtypes` cover the dtype to be served. The newest such report
decides: a newer failing run shadows an older passing one, so a regression cannot be served on the strength
of a stale green report. Its verdict is recomputed from its results (a summary that contradicts its results
is refused), and with a report key only reports whose signature verifies are considered. A run narrowed
with `--only` is not a gate (it could have selected a single self-test) and never counts; neither does a
`parity --endpoint` run (it judged some other server, not this one's model). Unreadable or schema-invalid
files are skipped with a warning.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3verify.gates.binding import recompute_summary, signature_problem, summary_problem
from k3verify.gates.report import validate_report

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class GateLookup:
    """What the report dir holds for one target: the deciding report (if any) and why it does or does not pass."""

    passing: Path | None
    newest: Path | None
    reason: str
    skipped: tuple[Path, ...] = ()


def _load_valid(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        validate_report(data)
    except Exception as exc:  # any unreadable/invalid file is ignored, loudly
        log.warning("ignoring gate report %s: %s: %s", path, type(exc).__name__, str(exc).splitlines()[0][:200])
        return None
    return data


def _mismatch(run: dict[str, Any], want: GateWant) -> str | None:
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


def lookup_report(report_dir: str | Path, want: GateWant) -> GateLookup:
    """Search report_dir recursively for report.json files bound to `want`; the newest decides."""
    root = Path(report_dir)
    if not root.is_dir():
        return GateLookup(None, None, f"report dir {root} does not exist")
    matches: list[tuple[str, str, Path, dict[str, Any]]] = []
    skipped: list[Path] = []
    others: Counter[str] = Counter()
    dtypes_seen: set[str] = set()
    for path in sorted(root.rglob("report.json")):
        data = _load_valid(path)
        untrusted = None if data is None or want.key is None else signature_problem(data, want.key)
        if untrusted is not None:
            log.warning("ignoring gate report %s: %s", path, untrusted)
        if data is None or untrusted is not None:
            skipped.append(path)
            continue
        run = data["run"]
        narrowed = "runs narrowed by --only" if run.get("only") else "--endpoint runs" if run.get("endpoint") else None
        mismatch = narrowed or _mismatch(run, want)
        if mismatch is None and want.dtype not in run["dtypes"]:
            dtypes_seen.update(run["dtypes"])
            mismatch = "other dtypes"
        if mismatch is not None:
            others[mismatch] += 1
            continue
        matches.append((run["started_at"], str(path), path, data))
    if not matches:
        return GateLookup(None, None, _no_match(want, others, dtypes_seen, skipped), tuple(skipped))
    _, _, newest, data = max(matches, key=lambda m: (m[0], m[1]))
    return _decide(newest, data, tuple(skipped))


def _decide(newest: Path, data: dict[str, Any], skipped: tuple[Path, ...]) -> GateLookup:
    """The deciding report passes only if its summary is what its results imply and that is "pass"."""
    problem = summary_problem(data)
    if problem is not None:
        return GateLookup(None, newest, f"the newest matching report {newest} cannot be trusted: {problem}", skipped)
    summary = recompute_summary(data)
    if summary["verdict"] != "pass":
        c = summary["counts"]
        why = (f"the newest matching report {newest} has verdict {summary['verdict']!r} "
               f"({c['fail']} fail, {c['vacuous']} vacuous, {c['error']} error)")
        if "setup_error" in summary:
            why += f": {summary['setup_error']}"
        return GateLookup(None, newest, why, skipped)
    return GateLookup(newest, newest, f"{newest} passed (started {data['run']['started_at']})", skipped)


def find_passing_report(report_dir: str | Path, want: GateWant) -> Path | None:
    """The newest report.json under report_dir bound to `want`, if it passes; else None."""
    return lookup_report(report_dir, want).passing
