"""The invocation matrix covers the parity command as the parser defines it: every flag, and every choice of a
flag with choices, appears in a CI cell or a documented manual command; docs/invocations.md lists each of them
(manual commands with their last recorded result); quick-suite invocations the matrix leaves to a full cell are
subsets of it."""

from __future__ import annotations

import argparse
from pathlib import Path

from invocations import CELLS, MANUAL

from k3verify.cli import build_parser
from k3verify.gates.core.suite import load_all_checks

DOC = Path(__file__).resolve().parents[2] / "docs" / "invocations.md"


def _parity_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["parity"]
    return parser


def _commands() -> list[list[str]]:
    """Every cell as test_parity_suites runs it (a report cell gets --report-dir), every manual command."""
    cells = [[*c.argv, *(() if c.lists else ("--report-dir", "DIR"))] for c in CELLS]
    return cells + [m.command.split() for m in MANUAL]


def test_every_parity_flag_and_choice_is_in_a_cell_or_a_manual_command() -> None:
    """Picked up from the parser, so a new flag or a new --dtype name is missing here until it is covered."""
    commands = _commands()
    used = {token for argv in commands for token in argv}
    missing = []
    for action in _parity_parser()._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags:
            continue
        if not used.intersection(flags):
            missing.append(flags[0])
            continue
        for choice in action.choices or ():
            if not any(argv[i] in flags and argv[i + 1] == str(choice) for argv in commands
                       for i in range(len(argv) - 1)):
                missing.append(f"{flags[0]} {choice}")
    assert not missing, f"not in any cell of tests/acceptance/invocations.py nor a manual command: {missing}"


def test_docs_list_every_cell_and_every_manual_command_with_its_result() -> None:
    text = DOC.read_text()
    for cell in CELLS:
        assert f"`{cell.command}`" in text, f"docs/invocations.md lacks the cell {cell.name}: {cell.command}"
    for manual in MANUAL:
        assert f"`{manual.command}`" in text and manual.result in text, f"docs/invocations.md lacks {manual.command}"


def test_quick_suite_is_a_subset_of_the_full_suite() -> None:
    """Why a preset with a full cell needs no quick cell: quick selects no check the full suite lacks."""
    checks = load_all_checks()
    assert checks and all("full" in c.suites for c in checks if "quick" in c.suites)
