"""A gate that binds: forged reports do not open `serve`; the run record must match what is served (digest,
version, source, device, preset, dtype); the verdict, every status, the check list and the dtypes are re-derived;
reports are ordered by the report index; with a key, any edit is refused."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from gate_reports import ago, edit_report, quick_checks, report_data, write_report
from test_serve_gating import refusal, serve_args, want

from k3verify.commands import serve
from k3verify.errors import UsageError
from k3verify.gates.core.binding import dtypes_of_run, recompute_summary, sign_report, source_digest
from k3verify.gates.trust.lookup import lookup_report

KEY = b"0123456789abcdef-test-key"
OTHER_DIGEST = "sha256:" + "1" * 64


@pytest.fixture(scope="module")
def tiny_digest() -> str:
    return serve.target_for(serve_args()).digest


def key_file(tmp_path: Path, key: bytes = KEY) -> Path:
    path = tmp_path / "report.key"
    path.write_bytes(key + b"\n")
    return path


def test_report_copied_from_another_preset_with_digest_edited_is_refused(tmp_path: Path, tiny_digest: str) -> None:
    """k3-syn-25's green report with the k3-tiny digest pasted in (its index re-recorded too): the preset differs."""
    write_report(tmp_path, digest=tiny_digest, preset="k3-syn-25")
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and "1 report(s) for other presets" in found.reason


def test_results_edited_to_fail_with_verdict_left_pass_is_refused(tmp_path: Path, tiny_digest: str) -> None:
    """Every result says fail, summary.verdict still says pass (index re-recorded, so the summary check decides)."""
    data = report_data(digest=tiny_digest)
    for r in data["results"]:
        r["status"] = "fail"
    write_report(tmp_path, data=data)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and "summary.verdict 'pass' contradicts its results, which give 'fail'" in found.reason


def test_counts_edited_too_still_refused_by_recomputation(tmp_path: Path, tiny_digest: str) -> None:
    """Editing summary.counts to agree with the edited verdict does not help: the results decide."""
    data = report_data(digest=tiny_digest, verdict="fail")
    data["summary"] = {"counts": {"pass": 4, "excused": 0,
                                  "fail": 0, "vacuous": 0, "error": 0, "skipped": 1}, "total": 5,
                       "verdict": "pass"}
    write_report(tmp_path, data=data)
    assert "contradicts its results" in lookup_report(tmp_path, want(tiny_digest)).reason
    assert recompute_summary(data)["verdict"] == "fail"


@pytest.mark.parametrize(("change", "bucket"), [
    ({"source": "sha256:" + "2" * 64}, "other k3verify sources"),
    ({"digest": OTHER_DIGEST}, "other checkpoints"),
    ({"device": "cuda"}, "other devices"),
    ({"version": "9.9.9"}, "other k3verify versions"),
])
def test_run_record_must_match_what_is_served(tmp_path: Path, tiny_digest: str, change: dict[str, Any],
                                              bucket: str) -> None:
    """A green report for another source digest, checkpoint, device or version is not this target's gate."""
    write_report(tmp_path, **({"digest": tiny_digest} | change))
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and f"1 report(s) for {bucket}" in found.reason


def test_serve_refuses_a_dtype_the_report_did_not_cover(tmp_path: Path, tiny_digest: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A report covering float32 only does not let `serve` run bfloat16; the refusal names both dtypes."""
    write_report(tmp_path, digest=tiny_digest, dtypes=["float32"])
    err = refusal(capsys, "--report-dir", str(tmp_path))
    assert "covers dtype bfloat16" in err and "cover float32 only" in err
    write_report(tmp_path / "both", digest=tiny_digest, dtypes=["float32", "bfloat16"])
    assert serve.require_gate(serve_args("--report-dir", str(tmp_path))).report == tmp_path / "both" / "report.json"


def test_without_a_key_a_writer_of_the_whole_directory_gets_through(tmp_path: Path, tiny_digest: str) -> None:
    """The documented limit (README threat model): a forger who writes report.json AND appends to the report index
    (full access to the directory) produces what k3verify would have written; only a key can catch that."""
    write_report(tmp_path, digest=tiny_digest, preset="k3-tiny")  # what such a forger would produce
    assert lookup_report(tmp_path, want(tiny_digest)).passing is not None


def test_with_a_key_only_untouched_signed_reports_count(tmp_path: Path, tiny_digest: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Signed → accepted; unsigned, signed with another key, or edited after signing → ignored, each named."""
    signed = sign_report(report_data(digest=tiny_digest), KEY)
    good = write_report(tmp_path / "good", data=signed, key=KEY)
    assert lookup_report(tmp_path, want(tiny_digest, key=KEY)).passing == good
    write_report(tmp_path / "unsigned", data=report_data(digest=tiny_digest))
    write_report(tmp_path / "other-key", data=sign_report(report_data(digest=tiny_digest), b"x" * 16), key=b"x" * 16)
    with caplog.at_level(logging.WARNING, logger="k3verify.gates.trust.lookup"):
        found = lookup_report(tmp_path, want(tiny_digest, key=KEY))
    assert found.passing == good and len(found.skipped) == 2
    assert "not signed" in caplog.text and "signed with key" in caplog.text
    edited = copy.deepcopy(signed)
    edited["run"]["seed"] = 7
    edited["run"]["started_at"] = ago(30)  # the newest, so it is the one looked at first
    write_report(tmp_path / "edited", data=edited, key=KEY)  # index re-recorded: only the signature can tell
    with caplog.at_level(logging.WARNING, logger="k3verify.gates.trust.lookup"):
        found = lookup_report(tmp_path, want(tiny_digest, key=KEY))
    assert found.passing == good and "edited after signing" in caplog.text


def test_serve_with_report_key_refuses_unsigned_reports(tmp_path: Path, tiny_digest: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --report-key FILE`: a green unsigned report is not enough; a signed one opens the gate."""
    write_report(tmp_path / "r", digest=tiny_digest)
    err = refusal(capsys, "--report-dir", str(tmp_path), "--report-key", str(key_file(tmp_path)))
    assert "1 invalid or untrusted file(s) ignored" in err
    write_report(tmp_path / "r", data=sign_report(report_data(digest=tiny_digest), KEY), key=KEY)
    args = serve_args("--report-dir", str(tmp_path), "--report-key", str(key_file(tmp_path)))
    assert serve.require_gate(args).report == tmp_path / "r" / "report.json"


def test_short_or_missing_key_file_is_a_usage_error(tmp_path: Path) -> None:
    """A key file under 16 bytes, or one that cannot be read, is refused naming the file."""
    with pytest.raises(UsageError, match="holds 5 bytes"):
        serve.require_gate(serve_args("--report-key", str(key_file(tmp_path, b"short"))))
    with pytest.raises(UsageError, match="cannot be read"):
        serve.require_gate(serve_args("--report-key", str(tmp_path / "absent.key")))


def test_source_digest_follows_every_package_file(tmp_path: Path) -> None:
    """Changing any byte of any file of the package changes the source digest; bytecode caches do not count."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "data.json").write_text("{}")
    before = source_digest(str(pkg))
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    assert source_digest.__wrapped__(str(pkg)) == before
    (pkg / "sub" / "data.json").write_text("{ }")
    assert source_digest.__wrapped__(str(pkg)) != before


def _refused(tmp_path: Path, tiny_digest: str, data: dict[str, Any], reason: str) -> None:
    """`data` written as an edit of a report k3verify wrote (index untouched), and again as a forger who also
    re-records the index: both refused, the second naming `reason` (the detector behind the index)."""
    edited = tmp_path / "edited"
    path = write_report(edited, digest=tiny_digest)
    edit_report(path, data)
    found = lookup_report(edited, want(tiny_digest))
    assert found.passing is None, found.reason
    reindexed = write_report(tmp_path / "reindexed", data=data)
    found = lookup_report(tmp_path / "reindexed", want(tiny_digest))
    assert found.passing is None and found.newest == reindexed and reason in found.reason, found.reason


def test_a_metric_far_past_its_bar_with_status_pass_is_refused(tmp_path: Path, tiny_digest: str) -> None:
    """A result whose metric is 339x its bar but whose status says pass: the status is re-decided from the metric,
    bar and control, by the code the run decided with."""
    data = report_data(digest=tiny_digest)
    rms = next(r for r in data["results"] if r["kind"] == "rms" and r["status"] == "pass")
    rms["metric"] = 339 * rms["bar"]
    _refused(tmp_path, tiny_digest, data, f"result {rms['id']} says 'pass', but its metric")
    assert "makes it 'fail'" in lookup_report(tmp_path / "reindexed", want(tiny_digest)).reason


def test_a_report_holding_one_check_with_counts_fixed_is_refused(tmp_path: Path, tiny_digest: str) -> None:
    """1 of the quick suite's checks, summary counts made consistent: refused, naming how many and which are
    missing."""
    data = report_data(digest=tiny_digest)
    data["results"] = data["results"][1:2]
    data["summary"] = {"counts": {"pass": 1, "excused": 0,
                                  "fail": 0, "vacuous": 0, "error": 0, "skipped": 0}, "total": 1,
                       "verdict": "pass"}
    total = len(quick_checks())
    _refused(tmp_path, tiny_digest, data, f"it holds 1 of the {total} checks of the quick suite; missing: "
                                          f"{quick_checks()[0].id}")


def test_an_fp32_only_report_with_dtypes_widened_is_refused(tmp_path: Path, tiny_digest: str) -> None:
    """A report whose checks built the served model in float32 only, with run.dtypes widened to bfloat16 too."""
    data = report_data(digest=tiny_digest, dtypes=["float32"])
    data["run"]["dtypes"] = ["bfloat16", "float32"]
    _refused(tmp_path, tiny_digest, data, "its run.dtypes ['bfloat16', 'float32'] is not what its checks ran: they "
                                          "built the served model in ['float32'] only")


def test_an_old_passing_report_dated_into_the_future_loses_to_a_newer_failing_one(tmp_path: Path,
                                                                                 tiny_digest: str) -> None:
    """An old green report re-dated past a newer red one: the edit is caught by the index (the gate stays shut,
    naming it); re-recorded in the index as well, its date is after the index's write time and it is refused for
    that."""
    old = write_report(tmp_path / "old", digest=tiny_digest, started_at=ago(7200))
    write_report(tmp_path / "new", digest=tiny_digest, verdict="fail", started_at=ago(60))
    data = json.loads(old.read_text())
    data["run"]["started_at"] = "2099-01-01T00:00:00+00:00"
    edit_report(old, data)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and found.newest == old and "it was edited after it was written" in found.reason
    write_report(tmp_path / "old", data=data)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and found.newest == old, found.reason
    assert "its run.started_at 2099-01-01T00:00:00+00:00 is after k3verify wrote it" in found.reason


def test_an_edit_of_a_written_report_is_named_by_the_index(tmp_path: Path, tiny_digest: str) -> None:
    """Any edit of report.json (the threat model's attacker) is refused as not what k3verify wrote; an older report
    put back in its place is refused as stale; a newer entry whose report was edited closes the gate rather than
    letting an older green report decide."""
    first = report_data(digest=tiny_digest)
    path = write_report(tmp_path / "r", data=first)
    edited = copy.deepcopy(first)
    edited["run"]["seed"] = 1
    edit_report(path, edited)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and "is not what k3verify wrote there" in found.reason, found.reason
    write_report(tmp_path / "r", digest=tiny_digest, verdict="fail")
    edit_report(path, first)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and "write #1 of its index, but write #2 came after it" in found.reason
    older = write_report(tmp_path / "a-green", digest=tiny_digest)
    write_report(tmp_path / "z-newer", digest=tiny_digest, verdict="fail")
    (tmp_path / "z-newer" / "report.json").unlink()
    (tmp_path / "r" / "report-index.jsonl").unlink()
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and found.newest == tmp_path / "z-newer" / "report.json", found.reason
    assert "cannot be read" in found.reason and older != found.newest


def test_a_consistent_inconclusive_report_does_not_open_the_gate(tmp_path: Path, tiny_digest: str) -> None:
    """Every whole-model check skipped, summary and dtypes made consistent (verdict inconclusive): admission still
    takes only "pass"."""
    data = report_data(digest=tiny_digest)
    for r in data["results"]:
        if r["id"].startswith(("model.logits.", "model.layerwise.", "served.")):
            r.update(status="skipped", metric=None, control=None, noise=None, serving_dtypes=[])
    data["run"]["dtypes"] = dtypes_of_run((r["status"], r["serving_dtypes"]) for r in data["results"])
    data["summary"] = recompute_summary(data)
    assert data["summary"]["verdict"] == "inconclusive"
    write_report(tmp_path, data=data)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and "has verdict 'inconclusive'" in found.reason, found.reason
