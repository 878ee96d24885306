"""One report from the reports of a gate run in parts (`parity --merge DIR ...`).

A real-size target on one card can take longer than one command may run (a lent GPU gives at most 10 minutes a
command), and each part in a process of its own also starts with an empty card. The parts are `parity --only ...`
runs of the same target, suite, seed, dtype, device and k3verify source; together they must hold every check of
the suite's gate exactly once. Each part's report must be what k3verify wrote (its index's latest write, its
summary what its results give). The merged report holds the parts' results as they were, records each part (its
directory, start, `--only` patterns and checks) in `run.parts`, starts when the first part started and is written
and indexed like any run's, so `serve` judges it as it judges a report of one command.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3verify.gates.core.binding import recompute_summary, summary_problem
from k3verify.gates.core.check import Check
from k3verify.gates.core.suite import dtypes_of_run, gate_checks
from k3verify.gates.report.index import REPORT_FILE, ReportIndexError, binding_problem, content_problem, read_index
from k3verify.gates.report.json_report import validate_report

# Fields of run that may differ between the parts of one gate run (the rest must be equal). The commit may differ
# where source_digest (every file of the package that ran the checks) does not: a part is not run again for an
# edit outside the package; each part's commit is kept in `parts`, the merged run names the newest part's.
PER_PART = ("only", "started_at", "wall_time_s", "dtypes", "git_dirty", "git_sha", "parts")


class MergeError(ValueError):
    """The parts cannot make one gate report; the message names the part and the field or check."""


def read_part(directory: Path) -> dict[str, Any]:
    """A part's report.json, refused unless it is its index's latest write and its summary is its results'."""
    path = directory / REPORT_FILE
    try:
        raw = path.read_bytes()
        entries = read_index(directory)
    except (OSError, ReportIndexError) as exc:
        raise MergeError(f"part {directory}: {exc}") from None
    data = json.loads(raw)
    validate_report(data)
    problem = content_problem(raw, entries) or binding_problem(entries[-1], data["run"]) or summary_problem(data)
    if problem is not None:
        raise MergeError(f"part {directory} cannot be trusted: {problem}")
    if data["run"].get("endpoint"):
        raise MergeError(f"part {directory} is a --endpoint run: it judged another server, not this model")
    if data["summary"].get("setup_error"):
        raise MergeError(f"part {directory} did not run its checks: {data['summary']['setup_error']}")
    return data


def merge_parts(directories: Sequence[Path], registered: Sequence[Check]) -> dict[str, Any]:
    """The merged report (validated, unsigned) of the parts in `directories`; MergeError naming what is wrong."""
    if len(directories) < 2:
        raise MergeError(f"--merge takes the directories of two or more parts; got {len(directories)}")
    parts = [(d, read_part(d)) for d in directories]
    first_dir, first = parts[0]
    run0 = first["run"]
    for directory, data in parts[1:]:
        for key in sorted(set(run0) | set(data["run"])):
            if key not in PER_PART and data["run"].get(key) != run0.get(key):
                raise MergeError(f"part {directory} ran with {key} {data['run'].get(key)!r}, part {first_dir} with "
                                 f"{run0.get(key)!r}: parts of one gate run share it")
    owner: dict[str, Path] = {}
    results: list[dict[str, Any]] = []
    for directory, data in parts:
        for result in data["results"]:
            if result["id"] in owner:
                raise MergeError(f"check {result['id']} ran in part {owner[result['id']]} and in part {directory}: "
                                 "each check of the gate belongs to one part")
            owner[result["id"]] = directory
            results.append(result)
    expected = {c.id for c in gate_checks(registered, run0["suite"])}
    missing, extra = sorted(expected - set(owner)), sorted(set(owner) - expected)
    if missing:
        raise MergeError(f"no part ran {len(missing)} check(s) of the {run0['suite']} suite's gate: "
                         f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    if extra:
        raise MergeError(f"checks outside the {run0['suite']} suite's gate: {', '.join(extra[:8])}")
    results.sort(key=lambda r: r["id"])
    newest = max((d for _, d in parts), key=lambda d: d["run"]["started_at"])
    run = {**run0, "git_sha": newest["run"]["git_sha"], "only": [],
           "started_at": min(d["run"]["started_at"] for _, d in parts),
           "wall_time_s": sum(d["run"]["wall_time_s"] for _, d in parts),
           "git_dirty": any(d["run"]["git_dirty"] for _, d in parts) if run0["git_dirty"] is not None else None,
           "dtypes": dtypes_of_run((r["status"], r.get("serving_dtypes") or ()) for r in results),
           "parts": [{"report": str(d), "started_at": data["run"]["started_at"], "git_sha": data["run"]["git_sha"],
                      "only": list(data["run"]["only"]),
                      "checks": len(data["results"]), "wall_time_s": data["run"]["wall_time_s"]}
                     for d, data in parts]}
    merged: dict[str, Any] = {"schema_version": first["schema_version"], "run": run, "results": results,
                              "summary": {}}
    merged["summary"] = recompute_summary(merged)
    validate_report(merged)
    return merged
