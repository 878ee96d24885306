"""A gate run in parts (`parity --only ...` twice) merged with `parity --merge` is one report `serve` accepts; parts
that do not make the whole gate, overlap, or were edited are refused naming the part or the check."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import k3verify
from k3verify.cli import main
from k3verify.gates.core.binding import source_digest
from k3verify.gates.core.suite import gate_checks, load_all_checks
from k3verify.gates.report.index import append_entry
from k3verify.gates.report.merge import MergeError, merge_parts
from k3verify.gates.trust.lookup import GateWant, lookup_report
from k3verify.target import resolve_target

PRESET = "k3-tiny"


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(report root, part A, part B): the quick suite's gate of k3-tiny split in two halves by id."""
    root = tmp_path_factory.mktemp("merge")
    ids = sorted(c.id for c in gate_checks(load_all_checks(), "quick"))
    halves = (ids[: len(ids) // 2], ids[len(ids) // 2:])
    dirs = (root / "part-a", root / "part-b")
    for part, chosen in zip(dirs, halves, strict=True):
        only = [word for cid in chosen for word in ("--only", cid)]
        # a part alone may be INCONCLUSIVE (4): its evidence is judged with the other part's, in the merge
        assert main(["parity", "--preset", PRESET, *only, "--report-dir", str(part)]) in (0, 4)
    return root, *dirs


def _want() -> GateWant:
    return GateWant(resolve_target(PRESET).digest, k3verify.__version__, "cpu", "bfloat16", source_digest(), PRESET)


def test_merged_parts_are_one_report_serve_accepts(parts: tuple[Path, Path, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root, a, b = parts
    assert lookup_report(root, _want()).passing is None  # runs narrowed by --only never open the gate
    merged = root / "merged"
    assert main(["parity", "--merge", str(a), str(b), "--report-dir", str(merged)]) == 0
    assert capsys.readouterr().out.startswith("PASS merged 2 parts")
    data = json.loads((merged / "report.json").read_text())
    assert data["run"]["only"] == [] and [p["report"] for p in data["run"]["parts"]] == [str(a), str(b)]
    assert len(data["results"]) == sum(p["checks"] for p in data["run"]["parts"])
    assert lookup_report(root, _want()).passing == merged / "report.json"


def test_parts_that_miss_overlap_or_were_edited_are_refused(parts: tuple[Path, Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    root, a, b = parts
    cases = {"overlap": ([a, a], "ran in part"), "short": ([a], "two or more parts")}
    edited = tmp_path / "edited"
    shutil.copytree(b, edited)
    text = (edited / "report.json").read_text()
    (edited / "report.json").write_text(text.replace('"status": "pass"', '"status": "skipped"', 1))
    cases["edited"] = ([a, edited], f"part {edited} cannot be trusted")
    for name, (dirs, why) in cases.items():
        out = tmp_path / f"merged-{name}"
        assert main(["parity", "--merge", *map(str, dirs), "--report-dir", str(out)]) == 2, name
        assert why in capsys.readouterr().err, name
        assert not (out / "report.json").exists(), name
    assert main(["parity", "--merge", str(a), str(b), "--preset", PRESET, "--report-dir", str(tmp_path / "x")]) == 2
    assert "--preset belong to the parts" in capsys.readouterr().err


def test_a_check_no_part_ran_is_named(parts: tuple[Path, Path, Path]) -> None:
    """The gate grows by one check the parts never ran (a newer k3verify's suite, say): the merge names it."""
    _, a, b = parts
    registered = load_all_checks()
    extra = dataclasses.replace(next(c for c in registered if c.id == "model.logits.fp32"), id="model.logits.extra")
    with pytest.raises(MergeError, match=r"no part ran 1 check\(s\) of the quick suite's gate: model.logits.extra"):
        merge_parts([a, b], [*registered, extra])


def _rewritten(part: Path, out: Path, **run: str) -> Path:
    """A copy of `part` as k3verify would have written it with these run fields (report and index line together)."""
    shutil.copytree(part, out)
    data = json.loads((part / "report.json").read_text())
    data["run"].update(run)
    raw = json.dumps(data, indent=1).encode()
    (out / "report.json").write_bytes(raw)
    append_entry(out, raw, data["run"])
    return out


def test_a_part_of_another_commit_merges_only_on_the_same_package_source(parts: tuple[Path, Path, Path],
                                                                         tmp_path: Path) -> None:
    """A part from a commit that edited nothing in the package is the same gate code: merged, its commit kept in
    `parts`; a part whose package differed is refused, naming source_digest."""
    _, a, b = parts
    later = json.loads((b / "report.json").read_text())["run"]["started_at"] + "Z"  # sorts after every real start
    other = _rewritten(b, tmp_path / "other-commit", git_sha="0" * 40, started_at=later)
    merged = merge_parts([a, other], load_all_checks())
    assert merged["summary"]["verdict"] == "pass" and merged["run"]["git_sha"] == "0" * 40
    a_sha = json.loads((a / "report.json").read_text())["run"]["git_sha"]
    assert [p["git_sha"] for p in merged["run"]["parts"]] == [a_sha, "0" * 40]
    edited = _rewritten(b, tmp_path / "other-source", git_sha="0" * 40, source_digest="sha256:" + "1" * 64)
    with pytest.raises(MergeError, match=r"ran with source_digest 'sha256:1111"):
        merge_parts([a, edited], load_all_checks())
