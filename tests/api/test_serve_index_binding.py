"""The index line, report.json's run and the target are one record: an index line edited to name another
checkpoint or wider dtypes is refused naming the field (with and without the report key), the order of reports
comes from inside the hashed report, not the index's editable write time, and a pass dated in the future or older
than --max-report-age is refused with its date."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from gate_reports import ago, report_data, write_report
from test_serve_gating import refusal, serve_args, want

from k3verify.commands import serve
from k3verify.gates.core.binding import sign_report
from k3verify.gates.report.index import INDEX_FILE
from k3verify.gates.trust.lookup import lookup_report

KEY = b"0123456789abcdef-index-key"
KL_DIGEST = "sha256:" + "7" * 64  # the checkpoint a genuine report vouches for (kl-tiny's, say)


@pytest.fixture(scope="module")
def tiny_digest() -> str:
    return serve.target_for(serve_args()).digest


def edit_index(directory: Path, *, written_at: str | None = None, **run: Any) -> None:
    """Rewrite the index's last line as an editor would: its run fields and/or its write time (signature kept)."""
    path = directory / INDEX_FILE
    lines = path.read_text().splitlines()
    last = json.loads(lines[-1])
    last["run"].update(run)
    if written_at is not None:
        last["written_at"] = written_at
    path.write_text("\n".join([*lines[:-1], json.dumps(last, sort_keys=True)]) + "\n")


def test_an_index_line_rebound_to_another_checkpoint_is_refused_naming_the_field(tmp_path: Path,
                                                                                 tiny_digest: str) -> None:
    """A genuine green report for another checkpoint and preset whose index line alone was edited to name k3-tiny:
    refused, naming the index's and the report's checkpoint_digest."""
    write_report(tmp_path / "r", digest=KL_DIGEST, preset="kl-tiny")
    assert lookup_report(tmp_path, want(tiny_digest)).passing is None  # the control: not k3-tiny's as written
    edit_index(tmp_path / "r", checkpoint_digest=tiny_digest, preset="k3-tiny")
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None, found.reason
    assert (f"its index line (write #1) says checkpoint_digest {tiny_digest!r} but report.json's run says "
            f"{KL_DIGEST!r}: the index was edited") in found.reason


def test_rebinding_under_the_report_key_is_refused_by_serve(tmp_path: Path, tiny_digest: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The same edit of a signed report's index line: `serve --report-key` refuses (exit 2), naming the field,
    though report.json's own signature verifies; the unedited signed report for k3-tiny opens the gate."""
    key_file = tmp_path / "report.key"
    key_file.write_bytes(KEY)
    write_report(tmp_path / "kl", data=sign_report(report_data(digest=KL_DIGEST, preset="kl-tiny"), KEY), key=KEY)
    edit_index(tmp_path / "kl", checkpoint_digest=tiny_digest, preset="k3-tiny")
    err = refusal(capsys, "--report-dir", str(tmp_path), "--report-key", str(key_file))
    assert "says checkpoint_digest" in err and KL_DIGEST in err and "Without --report-key" not in err, err
    good = write_report(tmp_path / "k3", data=sign_report(report_data(digest=tiny_digest, started_at=ago(5)), KEY),
                        key=KEY)
    gated = serve.require_gate(serve_args("--report-dir", str(tmp_path), "--report-key", str(key_file)))
    assert gated.report == good


def test_an_index_line_edited_after_signing_does_not_count_under_the_key(tmp_path: Path, tiny_digest: str) -> None:
    """With a key, an index line whose write time was moved (its run unchanged) no longer verifies and is ignored,
    naming the line; without the edit it counts."""
    write_report(tmp_path / "r", data=sign_report(report_data(digest=tiny_digest), KEY), key=KEY)
    assert lookup_report(tmp_path, want(tiny_digest, key=KEY)).passing is not None
    edit_index(tmp_path / "r", written_at=ago(1))
    found = lookup_report(tmp_path, want(tiny_digest, key=KEY))
    assert found.passing is None and len(found.skipped) == 1, found.reason


def test_dtypes_widened_in_the_index_line_only_are_refused(tmp_path: Path, tiny_digest: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A float32-only report whose index line was edited to list bfloat16 too: `serve --dtype bfloat16` refuses,
    naming the dtypes of both, and (run without a key) says what a writer could still do."""
    write_report(tmp_path / "r", digest=tiny_digest, dtypes=["float32"])
    edit_index(tmp_path / "r", dtypes=["bfloat16", "float32"])
    err = refusal(capsys, "--report-dir", str(tmp_path))
    assert "says dtypes ['bfloat16', 'float32'] but report.json's run says ['float32']" in err, err
    assert "Without --report-key, an edit of a report or of its index line is refused, but whoever can write" in err


def test_an_index_line_edited_to_hide_a_newer_failing_run_is_refused(tmp_path: Path, tiny_digest: str) -> None:
    """The newer failing run's index line edited to name another checkpoint (so that an older pass decides): the
    failing report's own run still names k3-tiny, so it is looked at, and refused naming the edit."""
    write_report(tmp_path / "old", digest=tiny_digest, started_at=ago(3600))
    write_report(tmp_path / "new", digest=tiny_digest, verdict="fail", started_at=ago(60))
    edit_index(tmp_path / "new", checkpoint_digest=KL_DIGEST)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and found.newest == tmp_path / "new" / "report.json"
    assert "the index was edited" in found.reason


@pytest.mark.parametrize("key", [None, KEY], ids=["no key", "key"])
def test_a_redated_index_line_does_not_reorder_reports(tmp_path: Path, tiny_digest: str, key: bytes | None) -> None:
    """An old pass whose index write time was moved past a newer failing run (an hour ahead) does not hide it: the
    failing run, which started last, decides (without the key; with it the moved line no longer verifies either)."""
    sign = (lambda d: sign_report(d, key)) if key is not None else (lambda d: d)
    write_report(tmp_path / "old", data=sign(report_data(digest=tiny_digest, started_at=ago(7200))), key=key)
    write_report(tmp_path / "new", data=sign(report_data(digest=tiny_digest, verdict="fail", started_at=ago(60))),
                 key=key)
    edit_index(tmp_path / "old", written_at=(datetime.now(UTC) + timedelta(minutes=2)).isoformat())
    found = lookup_report(tmp_path, want(tiny_digest, key=key))
    assert found.passing is None, found.reason
    assert found.newest == tmp_path / "new" / "report.json" and "verdict 'fail'" in found.reason


def test_a_pass_dated_in_the_future_is_refused_with_its_date(tmp_path: Path, tiny_digest: str) -> None:
    """A pass whose run starts a day from now, its index line agreeing (both written as the forger would): refused,
    naming the date."""
    later = (datetime.now(UTC) + timedelta(days=1)).isoformat(timespec="microseconds")
    write_report(tmp_path / "r", digest=tiny_digest, started_at=later)
    edit_index(tmp_path / "r", written_at=later)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing is None and f"its run.started_at {later} is in the future" in found.reason, found.reason


def test_a_pass_older_than_the_max_age_is_refused_with_its_date(tmp_path: Path, tiny_digest: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A year-old pass (its index agreeing) is refused by default (30 days), naming its date and the flag; a
    --max-report-age that covers it lets it decide."""
    old = (datetime.now(UTC) - timedelta(days=365)).isoformat(timespec="microseconds")
    write_report(tmp_path / "r", digest=tiny_digest, started_at=old)
    edit_index(tmp_path / "r", written_at=old)
    err = refusal(capsys, "--report-dir", str(tmp_path))
    assert f"it passed on {old}, 365 days ago; a pass older than 30 days is refused (--max-report-age)" in err, err
    gated = serve.require_gate(serve_args("--report-dir", str(tmp_path), "--max-report-age", "400"))
    assert gated.report == tmp_path / "r" / "report.json"
    assert "--max-report-age must be > 0 days; got 0.0" in refusal(capsys, "--report-dir", str(tmp_path),
                                                                   "--max-report-age", "0")
