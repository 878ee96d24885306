"""The runner's bookkeeping without running parity: stale snippets, renamed killers, forbidden targets,
equivalents and the classification of a child's report."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from k3verify.cli import main
from k3verify.gates.mutation.runner import (
    CatalogError,
    ChildRun,
    Mutant,
    classify,
    expand_killers,
    load_catalog,
    stale_reason,
)
from k3verify.gates.report.json_report import load_report

MXFP4 = "k3verify.checkpoint.mxfp4:decode_codes"


def write_catalog(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "entries.py").write_text("from k3verify.gates.mutation.runner import Mutant\n\n" + textwrap.dedent(body))
    return folder


def run_mutate(tmp_path: Path, catalog: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    rc = main(["mutate", "--catalog", str(catalog), "--report-dir", str(tmp_path / "report"), *extra])
    return rc, capsys.readouterr().out


def test_absent_old_snippet_is_an_error_not_a_kill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mutant whose `old` text is not in the target file (code moved) is reported ERROR and fails the run."""
    catalog = write_catalog(tmp_path / "cat", f"""
        MUTANTS = [Mutant(id="stale.one", fault="text that no longer exists", target="{MXFP4}",
                          old="this snippet was refactored away", new="x", killers=["gates.selftest.*"])]
    """)
    rc, out = run_mutate(tmp_path, catalog, capsys)
    assert rc == 1
    assert "ERROR: stale.one" in out and "occurs 0 times" in out
    assert out.strip().splitlines()[-1] == "killed 0/1 (score 0.0%)"


def test_renamed_killer_makes_the_mutant_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A killer id that matches no registered check (renamed/removed check) is ERROR, never a silent kill."""
    catalog = write_catalog(tmp_path / "cat", f"""
        MUTANTS = [Mutant(id="renamed.killer", fault="low nibble masked to 3 bits", target="{MXFP4}",
                          old="low = packed & 0x0F", new="low = packed & 0x07", killers=["weights.no_such_check"])]
    """)
    rc, out = run_mutate(tmp_path, catalog, capsys)
    assert rc == 1
    assert "ERROR: renamed.killer" in out and "weights.no_such_check" in out
    assert out.strip().splitlines()[-1] == "killed 0/1 (score 0.0%)"


def test_equivalent_mutants_leave_the_denominator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Score = killed / (total - equivalent); an equivalent entry is reported with its proof, not run."""
    catalog = write_catalog(tmp_path / "cat", f"""
        MUTANTS = [
            Mutant(id="eq.one", fault="same bits, other spelling", target="{MXFP4}", old="low = packed & 0x0F",
                   new="low = packed & 15", killers=["gates.selftest.*"], equivalent="0x0F == 15"),
            Mutant(id="stale.two", fault="gone", target="{MXFP4}", old="nowhere in the file", new="y",
                   killers=["gates.selftest.*"]),
        ]
    """)
    rc, out = run_mutate(tmp_path, catalog, capsys)
    assert rc == 1
    assert out.strip().splitlines()[-1] == "killed 0/1 (score 0.0%)"
    rows = {m["id"]: m for m in load_report(tmp_path / "report")["mutations"]}
    assert rows["eq.one"]["status"] == "equivalent" and "0x0F == 15" in rows["eq.one"]["reason"]
    assert rows["stale.two"]["status"] == "error"


@pytest.mark.parametrize("target", ["k3verify.oracle.k3_reference:forward", "k3verify.gates.core.compare:compare",
                                    "k3verify.gates.mutation.runner:classify"])
def test_judge_code_cannot_be_mutated(target: str) -> None:
    """Mutating the oracle or the gates proves nothing: such entries are rejected when the catalog loads."""
    with pytest.raises(CatalogError, match="not mutable"):
        Mutant(id="judge", fault="mutate the judge", target=target, old="a", new="b", killers=["x.y"])


def test_mutated_copy_must_compile() -> None:
    """A replace that produces invalid Python is reported (ERROR), not counted as killed by an import crash."""
    bad = Mutant(id="syntax", fault="broken syntax", target=MXFP4, old="low = packed & 0x0F", new="low = = 1",
                 killers=["x.y"])
    reason = stale_reason(bad)
    assert reason is not None and "does not compile" in reason


def test_killer_globs_expand_to_registered_ids() -> None:
    """Globs expand against the registry; an unmatched pattern is returned so the runner can refuse it."""
    ids = ["kda.conv.packed", "kda.forward", "mla.forward"]
    assert expand_killers(["kda.*", "nothing.*"], ids) == (["kda.conv.packed", "kda.forward"], ["nothing.*"])


def _report(**statuses: str) -> dict[str, Any]:
    return {"results": [{"id": i.replace("_", "."), "status": s, "reason": None} for i, s in statuses.items()]}


@pytest.mark.parametrize(("statuses", "want"), [
    ({"a_x": "fail", "b_y": "pass"}, "killed"),
    ({"a_x": "error", "b_y": "pass"}, "killed"),
    ({"a_x": "pass", "b_y": "pass"}, "survived"),
    ({"a_x": "pass", "b_y": "skipped"}, "error"),
    ({"a_x": "fail"}, "error"),
])
def test_classification_of_a_child_report(statuses: dict[str, str], want: str) -> None:
    """Killed iff an expected killer went red; a skipped or missing expected killer is an error."""
    mutant = Mutant(id="m", fault="f", target=MXFP4, old="a", new="b", killers=["a.*"])
    child = ChildRun(1, _report(**statuses), "/tmp/copy/k3verify/__init__.py", "", 0.1)
    assert classify(mutant, "k3-tiny", ["a.x", "b.y"], child).status == want


def test_child_that_imported_the_installed_package_is_an_error() -> None:
    """If the child did not import the mutated copy, nothing it reports counts."""
    mutant = Mutant(id="m", fault="f", target=MXFP4, old="a", new="b", killers=["a.*"])
    child = ChildRun(3, _report(a_x="fail"), None, "child imported /work/main/k3verify", 0.1)
    assert classify(mutant, "k3-tiny", ["a.x"], child).status == "error"


def test_catalog_entries_apply_to_the_current_code() -> None:
    """Every catalog entry's snippet still occurs exactly once (or its patch target resolves): a refactor that
    moves mutated code must update the catalog instead of leaving stale mutants behind."""
    mutants = load_catalog()
    assert len(mutants) >= 40
    stale = {m.id: stale_reason(m) for m in mutants}
    assert {k: v for k, v in stale.items() if v} == {}
