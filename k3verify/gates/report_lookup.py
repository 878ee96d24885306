"""The gate `serve` must pass: a green report.json for exactly this checkpoint, version and device kind.

The newest report for the (digest, version, device) triple decides: a newer failing run shadows an
older passing one, so a regression cannot be served on the strength of a stale green report. A run
narrowed with `--only` is not a gate (it could have selected a single self-test) and never counts; neither does a
`parity --endpoint` run (it judged some other server, not this one's model).
Unreadable or schema-invalid files (e.g. half-written) are skipped with a warning naming them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3verify.gates.report import validate_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateLookup:
    """What the report dir holds for one checkpoint: the deciding report (if any) and why it does or does not pass."""

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


def lookup_report(report_dir: str | Path, digest: str, version: str, device_kind: str) -> GateLookup:
    """Search report_dir recursively for report.json files matching the checkpoint triple."""
    root = Path(report_dir)
    if not root.is_dir():
        return GateLookup(None, None, f"report dir {root} does not exist")
    matches: list[tuple[str, str, Path, dict[str, Any]]] = []
    skipped: list[Path] = []
    others = narrowed = 0
    for path in sorted(root.rglob("report.json")):
        data = _load_valid(path)
        if data is None:
            skipped.append(path)
            continue
        run = data["run"]
        if run.get("only") or run.get("endpoint"):
            narrowed += 1
            continue
        if (run["checkpoint_digest"], run["k3verify_version"], run["device"]) == (digest, version, device_kind):
            matches.append((run["started_at"], str(path), path, data))
        else:
            others += 1
    if not matches:
        why = f"no report for checkpoint {digest} with k3verify {version} on {device_kind}"
        detail = (f" ({others} report(s) for other checkpoints/versions/devices, {narrowed} narrowed by --only or "
                  "--endpoint")
        detail += f", {len(skipped)} invalid file(s) ignored)" if skipped else ")"
        return GateLookup(None, None, why + detail, tuple(skipped))
    _, _, newest, data = max(matches, key=lambda m: (m[0], m[1]))
    verdict = data["summary"]["verdict"]
    if verdict != "pass":
        c = data["summary"]["counts"]
        why = (f"the newest matching report {newest} has verdict {verdict!r} "
               f"({c['fail']} fail, {c['vacuous']} vacuous, {c['error']} error)")
        return GateLookup(None, newest, why, tuple(skipped))
    return GateLookup(newest, newest, f"{newest} passed (started {data['run']['started_at']})", tuple(skipped))


def find_passing_report(report_dir: str | Path, digest: str, version: str, device_kind: str) -> Path | None:
    """The newest report.json under report_dir for this checkpoint digest, k3verify version and device kind,
    if its verdict is pass; else None."""
    return lookup_report(report_dir, digest, version, device_kind).passing
