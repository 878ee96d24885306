"""Console output for a run: a rich progress bar while checks run, then a summary table grouped by
component and a one-line verdict. Kept apart from the runner so run_suite stays UI-free."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from k3verify.gates.core.check import Check, Result, Status
from k3verify.gates.core.excused import status_label
from k3verify.gates.core.resources import RESOURCE_METRICS
from k3verify.gates.core.suite import RunResult

STATUS_STYLE = {
    Status.PASS: "bold green", Status.EXCUSED: "bold yellow", Status.FAIL: "bold red", Status.VACUOUS: "bold magenta",
    Status.ERROR: "bold yellow", Status.SKIPPED: "dim",
}


@dataclass
class ProgressHooks:
    on_start: Callable[[Check], None]
    on_result: Callable[[Result], None]


@contextmanager
def progress_hooks(total: int, console: Console | None = None, verbose: bool = False) -> Iterator[ProgressHooks]:
    """Yields (on_start, on_result) callbacks for run_suite that drive a rich progress bar; a check that does not
    pass gets a line, and with `verbose` every check does, with its wall time (and its CUDA peak on a GPU)."""
    console = console or make_console(stderr=True)
    progress = Progress(TextColumn("[bold]parity[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=console, transient=True)
    with progress:
        task = progress.add_task("", total=total)

        def on_start(check: Check) -> None:
            progress.update(task, description=check.id)

        def on_result(result: Result) -> None:
            if result.status is not Status.PASS or verbose:
                style = STATUS_STYLE[result.status]
                label = status_label(result.status.value, result.metrics).upper()
                took = f" [dim]({result.duration_s:.1f} s" + "".join(
                    f", {name} peak {result.metrics[key]:.1f} GiB" for key, name in RESOURCE_METRICS.items()
                    if key in result.metrics) + ")[/]" \
                    if verbose else ""
                progress.console.print(f"[{style}]{label:8}[/] {result.id}{took}: {escape(result.reason or '')}")
            if not result.id.startswith("gates.import."):
                progress.advance(task)

        yield ProgressHooks(on_start, on_result)


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def summary_table(results: Sequence[Result]) -> Table:
    """One row per check, a heading row per component; the check id never wraps (it is what you grep)."""
    table = Table(title="k3verify parity",
                  caption="noise: r recorded (k3verify/gates/core/noise.json), m measured this run; "
                  "a noise-derived RMS bar = max(4 x noise, floor): report.html#bars")
    table.add_column("check", no_wrap=True)
    for name in ("status", "kind"):
        table.add_column(name, no_wrap=True)
    for name in ("metric", "bar", "noise", "margin"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("control", no_wrap=True)
    previous = None
    for r in sorted(results, key=lambda r: (r.component, r.id)):
        if r.component != previous:
            table.add_row(f"[bold underline]{r.component}[/]", end_section=False)
            previous = r.component
        margin = _fmt(r.margin) + (" [yellow]thin[/]" if r.thin else "")
        control = "—" if r.control is None else (
            "[green]caught[/]" if r.control.status == "fail" else "[magenta]NOT caught[/]")
        noise = "—" if r.noise is None else f"{_fmt(r.noise['value'])} {r.noise['source'][0]}"
        status = f"[{STATUS_STYLE[r.status]}]{status_label(r.status.value, r.metrics)}[/]"
        table.add_row(f"  {r.id}", status, r.kind, _fmt(r.metric), _fmt(r.bar), noise, margin, control)
    return table


def make_console(stderr: bool = False) -> Console:
    """Rich assumes 80 columns when not on a terminal; CI logs are wide enough for the full table."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=160)


def verdict_line(run: RunResult) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in run.counts.items() if n) or "no checks"
    colour = {"pass": "green", "inconclusive": "yellow"}.get(run.verdict, "red")
    why = f": {'; '.join(run.missing_evidence)} --" if run.verdict == "inconclusive" else ""
    return (f"[bold {colour}]{run.verdict.upper()}[/]{escape(why)} {counts} in {run.run.wall_time_s:.1f}s "
            f"({run.run.suite}, {run.run.device}, seed {run.run.seed})")


def print_summary(run: RunResult, console: Console | None = None, report_dir: str | None = None) -> None:
    console = console or make_console()
    endpoint = run.run.endpoint or {}
    for a in endpoint.get("accepted_conventions") or []:
        console.print(escape(f"accepted deviation: {a['convention']}={a['value']} instead of the released "
                             f"{a['released']} ({a['site']})"))
    console.print(summary_table(run.results))
    if endpoint.get("explanation"):
        console.print(escape(f"endpoint: {endpoint['explanation']['headline']}"))
    if report_dir is not None:
        console.print(f"reports: {report_dir}/report.json, report.html, junit.xml")
    console.print(verdict_line(run))
