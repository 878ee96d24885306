"""`k3verify mutate` end to end: real child processes on package copies, a real check as the killer.

The killer is `oracle.mxfp4.*` (the checkpoint MXFP4 decoder against hand-decoded values), so these
tests need no serving model and stay fast."""

from __future__ import annotations

import contextlib
import io
import textwrap
from pathlib import Path
from typing import Any

import pytest

import k3verify.commands.mutate as command
from k3verify.cli import main
from k3verify.gates.mutation.runner import PACKAGE_DIR, Mutant, run_child
from k3verify.gates.report.json_report import load_report

CATALOG = '''
import torch

from k3verify.gates.mutation.runner import Mutant


def doubled(original):
    def dequantize(packed, scale, dtype=torch.float32, group_size=32):
        return original(packed, scale, dtype, group_size) * 2
    return dequantize


MUTANTS = [
    Mutant(id="e2e.high_nibble_first", fault="MXFP4 codes decoded high nibble first",
           target="k3verify.checkpoint.mxfp4:decode_codes", old="torch.stack((low, high), dim=-1)",
           new="torch.stack((high, low), dim=-1)", killers=["oracle.mxfp4.*"]),
    Mutant(id="e2e.scale_doubled", fault="every dequantized weight doubled (patch kind)", kind="patch",
           target="k3verify.checkpoint.mxfp4:dequantize", patch=doubled, killers=["oracle.mxfp4.dequant_vs_hand"]),
    Mutant(id="e2e.comment_only", fault="a comment reworded: changes nothing, must survive",
           target="k3verify.checkpoint.mxfp4:decode_codes", old="# E2M1 code -> value; bit 3 is the sign.",
           new="# E2M1 code to value (sign in bit 3)", killers=["oracle.mxfp4.*"]),
]
'''


@pytest.fixture(scope="module")
def mutate_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("e2e")
    (root / "cat").mkdir()
    (root / "cat" / "entries.py").write_text(textwrap.dedent(CATALOG))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["mutate", "--catalog", str(root / "cat"), "--report-dir", str(root / "report"), "--jobs", "2"])
    return {"rc": rc, "out": out.getvalue(), "report": load_report(root / "report"), "dir": root / "report"}


def test_real_mutant_is_killed(mutate_run: dict[str, Any]) -> None:
    """High-nibble-first decoding, applied to a package copy in a child process, is caught by its killer."""
    rows = {m["id"]: m for m in mutate_run["report"]["mutations"]}
    assert rows["e2e.high_nibble_first"]["status"] == "killed"
    assert rows["e2e.high_nibble_first"]["killers"] == ["oracle.mxfp4.dequant_vs_hand"]


def test_patch_mutant_is_applied_in_the_child(mutate_run: dict[str, Any]) -> None:
    """A patch-kind mutant swaps the attribute inside the child before parity runs."""
    rows = {m["id"]: m for m in mutate_run["report"]["mutations"]}
    assert rows["e2e.scale_doubled"]["status"] == "killed"


def test_harmless_mutant_survives_and_fails_the_command(mutate_run: dict[str, Any]) -> None:
    """A comment change survives; any survivor makes `mutate` exit non-zero; the last line states the score."""
    rows = {m["id"]: m for m in mutate_run["report"]["mutations"]}
    assert rows["e2e.comment_only"]["status"] == "survived"
    assert mutate_run["rc"] == 1
    lines = mutate_run["out"].strip().splitlines()
    assert lines[-1] == "killed 2/3 (score 66.7%)"
    assert any(line.startswith("SURVIVED: e2e.comment_only") and "a comment reworded" in line for line in lines)


def test_report_carries_the_kill_matrix(mutate_run: dict[str, Any]) -> None:
    """report.json validates with mutations[] and the HTML renders the kill matrix."""
    report = mutate_run["report"]
    assert report["summary"]["mutation_counts"] == {"killed": 2, "survived": 1, "error": 0, "equivalent": 0}
    assert all(m["expected_killers"] == ["oracle.mxfp4.dequant_vs_hand"] for m in report["mutations"])
    html = (mutate_run["dir"] / "report.html").read_text()
    assert "Kill matrix" in html and "e2e.high_nibble_first" in html


def test_child_imports_the_copy_not_the_installed_package(tmp_path: Path) -> None:
    """The child's k3verify comes from the temporary copy (cwd and PYTHONPATH), never the editable install."""
    child = run_child(None, "k3-tiny", ["oracle.mxfp4.dequant_vs_hand"], catalog_dir=tmp_path,
                      cache_dir=tmp_path / "cache", seed=0, threads=1, timeout_s=300)
    assert child.returncode == 0, child.output
    assert child.imported_from is not None and "k3v-mutant-" in child.imported_from
    assert not Path(child.imported_from).is_relative_to(PACKAGE_DIR)


def test_red_clean_run_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """If the unmutated run is not green, mutate refuses (exit 2) and names the red check."""
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "entries.py").write_text(textwrap.dedent(CATALOG))
    broken = Mutant(id="broken.clean", fault="stand-in for a red tree", target="k3verify.checkpoint.mxfp4:decode_codes",
                    old="torch.stack((low, high), dim=-1)", new="torch.stack((high, low), dim=-1)",
                    killers=["oracle.mxfp4.*"])
    real_run_child = command.run_child

    def red_clean(mutant: Mutant | None, *args: Any, **kwargs: Any) -> Any:
        return real_run_child(broken if mutant is None else mutant, *args, **kwargs)

    monkeypatch.setattr(command, "run_child", red_clean)
    rc = main(["mutate", "--catalog", str(tmp_path / "cat"), "--only", "e2e.high_nibble_first",
               "--report-dir", str(tmp_path / "report")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "clean (unmutated) run on k3-tiny is not green" in err and "oracle.mxfp4.dequant_vs_hand" in err
    assert not (tmp_path / "report" / "report.json").exists()


def test_wide_run_records_unexpected_killers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--wide runs the whole suite per mutant (here the quick suite, a quick mutant): a layer fault must also turn
    checks beyond its expected ones red."""
    rc = main(["mutate", "--only", "mla.gate.dropped", "--suite", "quick", "--wide", "--report-dir",
               str(tmp_path / "report")])
    capsys.readouterr()
    (row,) = load_report(tmp_path / "report")["mutations"]
    assert rc == 0 and row["status"] == "killed"
    assert set(row["killers"]) - set(row["expected_killers"]), row
