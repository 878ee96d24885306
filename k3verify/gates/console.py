"""Console output for a run: a rich progress bar while checks run, then a summary table grouped by
component and a one-line verdict. Kept apart from the runner so run_suite stays UI-free."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from k3verify.gates.gate import Check, Result, Status
from k3verify.gates.suite import RunResult

STATUS_STYLE = {
    Status.PASS: "bold green", Status.FAIL: "bold red", Status.VACUOUS: "bold magenta",
    Status.ERROR: "bold yellow", Status.SKIPPED: "dim",
}


@dataclass
class ProgressHooks:
    on_start: Callable[[Check], None]
    on_result: Callable[[Result], None]


@contextmanager
def progress_hooks(total: int, console: Console | None = None) -> Iterator[ProgressHooks]:
    """Yields (on_start, on_result) callbacks for run_suite that drive a rich progress bar."""
    console = console or Console(stderr=True)
    progress = Progress(TextColumn("[bold]parity[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=console, transient=True)
    with progress:
        task = progress.add_task("", total=total)

        def on_start(check: Check) -> None:
            progress.update(task, description=check.id)

        def on_result(result: Result) -> None:
            if result.status is not Status.PASS:
                style = STATUS_STYLE[result.status]
                progress.console.print(f"[{style}]{result.status.value.upper():8}[/] {result.id}: {result.reason}")
            if not result.id.startswith("gates.import."):
                progress.advance(task)

        yield ProgressHooks(on_start, on_result)


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def summary_table(results: Sequence[Result]) -> Table:
    table = Table(title="k3verify parity", show_lines=False)
    for name, justify in (("component", "left"), ("check", "left"), ("kind", "left"), ("status", "left"),
                          ("metric", "right"), ("bar", "right"), ("margin", "right"), ("control", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    previous = None
    for r in sorted(results, key=lambda r: (r.component, r.id)):
        component = r.component if r.component != previous else ""
        if r.component != previous and previous is not None:
            table.add_section()
        previous = r.component
        margin = _fmt(r.margin) + (" [yellow](thin)[/]" if r.thin else "")
        control = "—" if r.control is None else (
            "[green]fails (good)[/]" if r.control.status == "fail" else "[magenta]passes (vacuous)[/]")
        table.add_row(component, r.id, r.kind, f"[{STATUS_STYLE[r.status]}]{r.status.value}[/]", _fmt(r.metric),
                      _fmt(r.bar), margin, control)
    return table


def verdict_line(run: RunResult) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in run.counts.items() if n) or "no checks"
    colour = "green" if run.verdict == "pass" else "red"
    return (f"[bold {colour}]{run.verdict.upper()}[/] {counts} in {run.run.wall_time_s:.1f}s "
            f"({run.run.suite}, {run.run.device}, seed {run.run.seed})")


def print_summary(run: RunResult, console: Console | None = None, report_dir: str | None = None) -> None:
    console = console or Console()
    console.print(summary_table(run.results))
    if report_dir is not None:
        console.print(f"reports: {report_dir}/report.json, report.html, junit.xml")
    console.print(verdict_line(run))
