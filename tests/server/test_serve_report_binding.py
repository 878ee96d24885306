"""A gate that binds: the forged reports of issue 15 no longer open `serve`; the run record must match what is
served (digest, version, source, device, preset, dtype); the verdict is recomputed; with a key, any edit is refused."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
from test_serve_gating import refusal, report_data, serve_args, want, write_report

from k3verify.cli import UsageError
from k3verify.commands import serve
from k3verify.gates.binding import recompute_summary, sign_report, source_digest
from k3verify.gates.report_lookup import lookup_report

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
    """Issue 15's first forgery: k3-syn-25's green report with the k3-tiny digest pasted in."""
    write_report(tmp_path, digest=tiny_digest, preset="k3-syn-25")
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and "1 report(s) for other presets" in found.reason


def test_results_edited_to_fail_with_verdict_left_pass_is_refused(tmp_path: Path, tiny_digest: str) -> None:
    """Issue 15's second forgery: every result says fail, summary.verdict still says pass."""
    data = report_data(digest=tiny_digest)
    for r in data["results"]:
        r["status"] = "fail"
    write_report(tmp_path, data=data)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and "summary.verdict 'pass' contradicts its results, which give 'fail'" in found.reason


def test_counts_edited_too_still_refused_by_recomputation(tmp_path: Path, tiny_digest: str) -> None:
    """Editing summary.counts to agree with the edited verdict does not help: the results decide."""
    data = report_data(digest=tiny_digest, verdict="fail")
    data["summary"] = {"counts": {"pass": 4, "fail": 0, "vacuous": 0, "error": 0, "skipped": 1}, "total": 5,
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


def test_without_a_key_a_consistent_forgery_is_accepted(tmp_path: Path, tiny_digest: str) -> None:
    """The documented limit (README threat model): another preset's report with digest AND preset edited is
    consistent, so only a key can catch it."""
    write_report(tmp_path, digest=tiny_digest, preset="k3-tiny")  # what the forger would produce
    assert lookup_report(tmp_path, want(tiny_digest)).passing is not None


def test_with_a_key_only_untouched_signed_reports_count(tmp_path: Path, tiny_digest: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Signed → accepted; unsigned, signed with another key, or edited after signing → ignored, each named."""
    signed = sign_report(report_data(digest=tiny_digest), KEY)
    good = write_report(tmp_path / "good", data=signed)
    assert lookup_report(tmp_path, want(tiny_digest, key=KEY)).passing == good
    newer = {"started_at": "2026-06-01T00:00:00+00:00"}
    write_report(tmp_path / "unsigned", data=report_data(digest=tiny_digest, **newer))
    write_report(tmp_path / "other-key", data=sign_report(report_data(digest=tiny_digest, **newer), b"x" * 16))
    edited = copy.deepcopy(signed)
    edited["run"]["started_at"] = newer["started_at"]
    write_report(tmp_path / "edited", data=edited)
    with caplog.at_level(logging.WARNING, logger="k3verify.gates.report_lookup"):
        found = lookup_report(tmp_path, want(tiny_digest, key=KEY))
    assert found.passing == good and len(found.skipped) == 3
    assert "not signed" in caplog.text and "signed with key" in caplog.text
    assert "edited after signing" in caplog.text


def test_serve_with_report_key_refuses_unsigned_reports(tmp_path: Path, tiny_digest: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --report-key FILE`: a green unsigned report is not enough; a signed one opens the gate."""
    write_report(tmp_path / "r", digest=tiny_digest)
    err = refusal(capsys, "--report-dir", str(tmp_path), "--report-key", str(key_file(tmp_path)))
    assert "1 invalid or untrusted file(s) ignored" in err
    write_report(tmp_path / "r", data=sign_report(report_data(digest=tiny_digest), KEY))
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
