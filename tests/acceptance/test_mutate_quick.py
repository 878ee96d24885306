"""Acceptance: CI runs the quick mutation subset — every quick mutant must be killed (none survives,
none errors), each in a fresh process against a mutated copy of the package."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3verify.cli import main


def test_quick_mutation_subset_kills_every_mutant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["mutate", "--suite", "quick", "--jobs", "2", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out, "mutate printed nothing"
    last = out[-1]
    assert last.startswith("killed "), last
    assert rc == 0, f"quick mutation subset: {last}\n" + "\n".join(out[-40:])
