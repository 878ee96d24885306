"""A hostile endpoint can neither hang nor crash `parity --endpoint`: one small local server per behaviour (trickle,
huge body, NaN, wrong types, redirect, 500-then-200, never-ending stream, tokens without logprobs), each run ending
within its deadline with a named reason, the right exit code (1 fail, 2 setup, 4 inconclusive) and a report of its
own in place of the previous one."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hostile_servers import hostile

from k3verify.cli import main
from k3verify.gates.report.json_report import load_report

HANG_S = 60.0  # a run still going after this long is hung (each deadline below is 1-2 s)


def parity(report_dir: Path, url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of `parity --endpoint url` on k3-tiny, in a thread bounded by HANG_S."""
    report_dir.mkdir(exist_ok=True)
    (report_dir / "report.json").write_text(json.dumps({"summary": {"verdict": "pass"}}))  # a previous verdict
    out: dict[str, Any] = {}

    def run() -> None:
        out["code"] = main(["parity", "--preset", "k3-tiny", "--dtype", "float32", "--report-dir", str(report_dir),
                            "--endpoint", url, "--timeout", "1.5", "--max-response-bytes", str(1 << 20), *args])

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_S)
    elapsed = time.monotonic() - started
    assert not worker.is_alive(), f"parity --endpoint still running after {HANG_S:g} s: it hangs"
    return out["code"], capsys.readouterr().err, elapsed


def results(report_dir: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    data = load_report(report_dir)
    return data, {r["id"]: r for r in data["results"]}


@pytest.mark.parametrize(("behaviour", "named"), [
    ("trickle", "no complete answer within the per-request deadline (--timeout) of 1.5 s"),
    ("huge_declared", "declares 104857600 bytes, more than the 1048576 read at most (--max-response-bytes)"),
    ("huge_undeclared", "passed 1048576 bytes (--max-response-bytes) and was not read further"),
    ("redirect", "307: a redirect to 'http://evil.example/v1/models', which is not followed"),
    ("wrong_models", "expected {'data': [{'id': ...}, ...]}"),
])
def test_a_server_that_cannot_be_set_up_is_exit_2_with_its_reason_reported(
        behaviour: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """At GET /v1/models: a trickle, a 100 MB body (declared or not), a redirect, a listing of the wrong type. The
    run ends by its deadline (1.5 s a request), exits 2 naming why, and its report (verdict error, marked as an
    endpoint run) replaces the previous one."""
    with hostile(behaviour) as server:
        code, err, elapsed = parity(tmp_path, server.url, "--only", "endpoint.greedy.tokens", capsys=capsys)
    assert code == 2 and named in err, err
    assert elapsed < 20, f"{behaviour}: {elapsed:.1f} s"
    data, _ = results(tmp_path)
    assert data["summary"]["verdict"] == "error" and named in data["summary"]["setup_error"]
    assert data["run"]["endpoint"]["url"] == server.url


def test_nan_logprobs_fail_and_the_report_shows_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NaN logprobs (bare NaN literals in the JSON) are a failing value: endpoint.logprobs.topk fails naming the
    non-finite values, exit 1, and report.json / report.html are written (no crash rendering them)."""
    with hostile("nan") as server:
        code, err, _ = parity(tmp_path, server.url, "--only", "endpoint.logprobs.topk", capsys=capsys)
    data, by_id = results(tmp_path)
    topk = by_id["endpoint.logprobs.topk"]
    assert code == 1 and topk["status"] == "fail", (topk["status"], topk["reason"], err)
    assert "non-finite values" in topk["reason"] and "NaN" in topk["reason"]
    assert data["summary"]["verdict"] == "fail" and (tmp_path / "report.html").stat().st_size > 0


def test_logprobs_of_the_wrong_type_are_named_and_inconclusive(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """logprobs.content = [5]: the probe names the field and its type, the output checks skip with that reason,
    and the verdict is inconclusive (exit 4), never a crash."""
    with hostile("wrong_logprobs") as server:
        code, _, _ = parity(tmp_path, server.url, "--only", "endpoint.greedy.tokens", capsys=capsys)
    data, by_id = results(tmp_path)
    greedy = by_id["endpoint.greedy.tokens"]
    assert code == 4 and data["summary"]["verdict"] == "inconclusive"
    assert greedy["status"] == "skipped" and "logprobs.content[0]: expected an object; got int 5" in greedy["reason"]


def test_tokens_without_logprobs_are_inconclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Answers with tokens but no logprobs give the checks nothing to compare: exit 4, the reason named."""
    with hostile("no_logprobs") as server:
        code, _, _ = parity(tmp_path, server.url, "--only", "endpoint.greedy.tokens", capsys=capsys)
    data, by_id = results(tmp_path)
    assert code == 4 and data["summary"]["verdict"] == "inconclusive"
    assert "completions answered without logprobs" in by_id["endpoint.greedy.tokens"]["reason"]


def test_a_500_between_200s_is_an_error_of_the_check_that_got_it(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The first request a check sends gets a 500 (the probe's and later ones 200): the check is an error naming
    the server's message, exit 1; the 200s after it do not hide it."""
    with hostile("500_then_200") as server:
        code, _, _ = parity(tmp_path, server.url, "--only", "endpoint.greedy.tokens", capsys=capsys)
    _, by_id = results(tmp_path)
    greedy = by_id["endpoint.greedy.tokens"]
    assert code == 1 and greedy["status"] == "error" and "500: upstream overloaded" in greedy["reason"]


def test_a_stream_that_never_ends_ends_at_the_size_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stream of events without `data: [DONE]`, forever: the streamed request stops at --max-response-bytes (or
    its deadline), endpoint.stream.identity is an error naming it, exit 1."""
    with hostile("endless_stream") as server:
        code, _, elapsed = parity(tmp_path, server.url, "--only", "endpoint.stream.identity", capsys=capsys)
    _, by_id = results(tmp_path)
    stream = by_id["endpoint.stream.identity"]
    assert code == 1 and stream["status"] == "error", (stream["status"], stream["reason"])
    assert "--max-response-bytes" in stream["reason"] or "--timeout" in stream["reason"], stream["reason"]
    assert elapsed < 30, f"{elapsed:.1f} s"
