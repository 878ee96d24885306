"""`k3verify mutate`: run the mutation catalog and write the kill matrix into report.json/report.html.

Exit codes: 0 every mutant killed (or proved equivalent); 1 a mutant survived or errored; 2 usage error
or a red clean run. The last console line is always `killed K/T (score S%)`, T excluding equivalents.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

import k3verify.gates.checks  # noqa: F401  (registration happens on import)
from k3verify.commands import Subparsers
from k3verify.errors import UsageError
from k3verify.gates import REGISTRY
from k3verify.gates.core.suite import collect_run_info
from k3verify.gates.mutation.runner import (
    DEFAULT_CATALOG,
    PARITY_INCONCLUSIVE,
    PARITY_RAN,
    CatalogError,
    Mutant,
    Outcome,
    classify,
    expand_killers,
    load_catalog,
    red_summary,
    run_child,
    select,
    stale_reason,
)
from k3verify.gates.report.html import render_html
from k3verify.gates.report.json_report import MUTATION_STATUSES, atomic_write_text, validate_report
from k3verify.gates.report.junit import render_junit


def register(sub: Subparsers) -> None:
    p = sub.add_parser("mutate", help="prove every gate bites: run the mutation catalog",
                       description=__doc__.splitlines()[0])
    p.add_argument("--only", action="extend", nargs="+", default=[], metavar="PATTERN",
                   help="mutant id globs (repeatable)")
    p.add_argument("--suite", choices=("quick", "full"), default="full",
                   help="quick: only entries marked quick=True (the CI subset), each judged by the quick suite's "
                        "checks among its expected killers where it has any (the full suite's otherwise)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="mutants run in parallel (default 1)")
    p.add_argument("--report-dir", type=Path, default=Path("reports/mutate"), metavar="DIR")
    p.add_argument("--preset", default=None, metavar="NAME", help="only (mutant, preset) pairs on this preset")
    p.add_argument("--catalog", type=Path, default=DEFAULT_CATALOG, metavar="DIR",
                   help="a folder of catalog files (default: the catalog shipped in k3verify/mutations/)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="device the children run parity on; cuda adds the CUDA-only mutants")
    p.add_argument("--wide", action="store_true",
                   help="every child runs the whole suite (the quick suite with --suite quick), not only the expected "
                        "killers (complete kill matrix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per child process (default 600)")
    p.set_defaults(func=run)


def registered_check_ids(suite: str = "full") -> list[str]:
    """Ids of every check in `suite`, as the unmutated package registers them."""

    return [c.id for c in REGISTRY if suite in c.suites]


def quick_killers(expected: list[str], quick_ids: set[str]) -> list[str]:
    """The expected killers a quick-subset mutant is judged by: those in the quick suite, where it has any (a
    mutant's full-suite killers include the long-context and whole-suite checks that cost minutes on CI's cores;
    `--suite full` runs them all)."""
    quick = [c for c in expected if c in quick_ids]
    return quick or expected


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1; got {args.jobs}")
    try:
        mutants = load_catalog(args.catalog)
    except CatalogError as exc:
        raise UsageError(str(exc)) from exc
    pairs = select(mutants, only=args.only, suite=args.suite, preset=args.preset, device=args.device)
    if not pairs:
        raise UsageError(f"no mutant matches --only {args.only} --suite {args.suite} --preset {args.preset}")
    with tempfile.TemporaryDirectory(prefix="k3v-mutate-cache-") as cache_dir:
        return _run(args, pairs, Path(cache_dir))


def _run(args: argparse.Namespace, pairs: Sequence[tuple[Mutant, str]], cache_dir: Path) -> int:
    known = registered_check_ids()
    quick_ids = set(registered_check_ids("quick")) if args.suite == "quick" else None
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None

    def child(mutant: Mutant | None, preset: str, ids: Sequence[str]) -> Any:
        return run_child(mutant, preset, ids, catalog_dir=args.catalog, cache_dir=cache_dir, seed=args.seed,
                         threads=threads, timeout_s=args.timeout, device=args.device)

    outcomes: list[Outcome] = []
    todo: list[tuple[Mutant, str, list[str]]] = []
    for mutant, preset in pairs:
        expected, unmatched = expand_killers(mutant.killers, known)
        if quick_ids is not None:
            expected = quick_killers(expected, quick_ids)
        reason = stale_reason(mutant) or (
            f"killer pattern(s) {unmatched} match no registered check (renamed or removed?)" if unmatched else None)
        if reason:
            outcomes.append(Outcome(mutant, preset, "error", expected_killers=expected, reason=reason))
        elif mutant.equivalent:
            outcomes.append(Outcome(mutant, preset, "equivalent", expected_killers=expected,
                                    reason=f"equivalent (not run): {mutant.equivalent}"))
        else:
            todo.append((mutant, preset, expected))

    wide = sorted(quick_ids) if quick_ids is not None else known
    clean_reports = clean_runs(todo, child, args.jobs, wide if args.wide else ())
    runnable = []
    for mutant, preset, expected in todo:
        passing = sorted(r["id"] for r in clean_reports[preset]["results"] if r["status"] == "pass")
        live = [c for c in expected if c in passing]
        if live:
            runnable.append((mutant, preset, live, passing if args.wide else live))
        else:
            outcomes.append(Outcome(mutant, preset, "error", expected_killers=expected,
                                    reason=f"no expected killer ran on {preset} in the clean run (all skipped)"))
    print(f"running {len(runnable)} mutant(s) with {args.jobs} job(s)", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(child, m, p, run_ids): (m, p, live) for m, p, live, run_ids in runnable}
        for n, fut in enumerate(as_completed(futures), 1):
            m, p, live = futures[fut]
            outcome = classify(m, p, live, fut.result())
            outcomes.append(outcome)
            print(f"[{n}/{len(runnable)}] {outcome.status:9} {m.id} @ {p} ({outcome.duration_s:.1f}s): "
                  f"{outcome.reason}", flush=True)
    write_reports(outcomes, clean_reports, args.report_dir, seed=args.seed, device=args.device)
    return summarize(outcomes)


def clean_runs(todo: Sequence[tuple[Mutant, str, list[str]]], child: Callable[..., Any], jobs: int,
               extra: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Run the union of expected killers (plus `extra`) once per preset on the unmutated copy; refuse unless green."""
    per_preset: dict[str, set[str]] = defaultdict(set)
    for _, preset, expected in todo:
        per_preset[preset].update(expected, extra)
    reports: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(child, None, p, sorted(ids)): p for p, ids in sorted(per_preset.items())}
        for fut in as_completed(futures):
            preset, done = futures[fut], fut.result()
            tail = "\n".join(done.output.strip().splitlines()[-8:])
            if done.imported_from is None or done.report is None or done.returncode not in PARITY_RAN:
                raise UsageError(f"clean run on {preset} exited {done.returncode} without a report:\n{tail}")
            red = red_summary(done.report)
            if red or done.returncode not in (0, PARITY_INCONCLUSIVE):
                raise UsageError(f"the clean (unmutated) run on {preset} is not green; fix it before mutating:\n  "
                                 + "\n  ".join(red or [tail]))
            print(f"clean run on {preset}: green ({len(done.report['results'])} checks, "
                  f"{done.duration_s:.1f}s; child imported {done.imported_from})", flush=True)
            reports[preset] = done.report
    return reports


def write_reports(outcomes: Sequence[Outcome], clean: dict[str, dict[str, Any]], report_dir: Path, *,
                  seed: int, device: str) -> None:
    """One report per preset (report_dir itself when there is one preset, else report_dir/<preset>/): the clean
    run's results plus the kill matrix, validated against the schema and written atomically. A preset on
    which nothing ran (every entry stale or equivalent) gets a report with no results, verdict fail."""

    presets = sorted({o.preset for o in outcomes})
    for preset in presets:
        rows = [o.record() for o in sorted(outcomes, key=lambda o: o.mutant.id) if o.preset == preset]
        data: dict[str, Any] = dict(clean[preset]) if preset in clean else {
            "schema_version": 1, "results": [],
            "run": asdict(collect_run_info(device=device, seed=seed, suite="full", preset=preset)),
            "summary": {"counts": dict.fromkeys(("pass", "fail", "vacuous", "error", "skipped"), 0), "total": 0,
                        "verdict": "fail"},
        }
        data["mutations"] = rows
        data["summary"] = dict(data["summary"], mutation_counts={s: sum(r["status"] == s for r in rows)
                                                                 for s in MUTATION_STATUSES})
        validate_report(data)
        out = report_dir if len(presets) == 1 else report_dir / preset
        atomic_write_text(out / "report.json", json.dumps(data, indent=2, allow_nan=False) + "\n")
        atomic_write_text(out / "report.html", render_html(data))
        atomic_write_text(out / "junit.xml", render_junit(data))
        print(f"wrote {out / 'report.json'} and report.html", flush=True)


def summarize(outcomes: Sequence[Outcome]) -> int:
    """Per-preset scores, the survivors with their fault sentence, errors; then the final line."""
    for preset in sorted({o.preset for o in outcomes}):
        rows = [o for o in outcomes if o.preset == preset]
        k, t = _score(rows)
        print(f"{preset}: killed {k}/{t}" + (f" ({100 * k / t:.1f}%)" if t else ""))
    for label in ("survived", "error"):
        bad = sorted((o for o in outcomes if o.status == label), key=lambda o: (o.mutant.id, o.preset))
        for o in bad:
            print(f"{label.upper()}: {o.mutant.id} @ {o.preset} [{o.mutant.target}] {o.mutant.fault} -- {o.reason}")
    killed, total = _score(outcomes)
    score = 100.0 * killed / total if total else 100.0
    sys.stdout.write(f"killed {killed}/{total} (score {score:.1f}%)\n")
    sys.stdout.flush()
    return 0 if killed == total else 1


def _score(outcomes: Sequence[Outcome]) -> tuple[int, int]:
    return (sum(o.status == "killed" for o in outcomes), sum(o.status != "equivalent" for o in outcomes))
