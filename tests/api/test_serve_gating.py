"""`k3verify serve` refuses to start without a passing gate report for this exact checkpoint, version and
device kind; the lookup is recursive, newest-wins, and skips corrupt files with a warning."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gate_reports import ago, write_report

import k3verify
from k3verify.cli import build_parser, main
from k3verify.commands import serve
from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError
from k3verify.gates.core.binding import source_digest
from k3verify.gates.trust.lookup import GateWant, find_passing_report, lookup_report

OTHER_DIGEST = "sha256:" + "0" * 64


def want(digest: str, device: str = "cpu", **kw: Any) -> GateWant:
    """What `serve` of k3-tiny in bf16 on `device` asks of a report."""
    return GateWant(digest, k3verify.__version__, device, "bfloat16", source_digest(), "k3-tiny", **kw)


def serve_args(*argv: str) -> ServeOptions:
    return ServeOptions.from_args(build_parser().parse_args(["serve", *argv]))


@pytest.fixture(scope="module")
def tiny_digest() -> str:
    return serve.target_for(serve_args()).digest


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["serve", *argv]) == 2
    return capsys.readouterr().err


def test_no_arguments_default_to_k3_tiny_and_reports_latest() -> None:
    """`k3verify serve` alone means the k3-tiny preset, reports/latest, 127.0.0.1."""
    args = serve_args()
    assert (args.preset, args.checkpoint, args.report_dir, args.host) == (None, None, Path("reports/latest"),
                                                                          "127.0.0.1")
    assert serve.parity_command(args) == "k3verify parity --preset k3-tiny --report-dir reports/latest"


def test_refuses_without_any_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No report → exit 2 naming the parity command to run and --run-gates."""
    err = refusal(capsys, "--report-dir", str(tmp_path))
    assert f"`k3verify parity --preset k3-tiny --report-dir {tmp_path}`" in err
    assert "--run-gates" in err and "refusing to serve" in err


def test_refuses_failing_report(tmp_path: Path, tiny_digest: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A failing report for this checkpoint → refused, naming the verdict."""
    write_report(tmp_path / "run1", digest=tiny_digest, verdict="fail")
    err = refusal(capsys, "--report-dir", str(tmp_path))
    assert "verdict 'fail'" in err and "k3verify parity --preset k3-tiny" in err


@pytest.mark.parametrize("mismatch", [{"digest": OTHER_DIGEST}, {"version": "0.0.0-other"}, {"device": "cuda"}],
                         ids=["digest", "version", "device"])
def test_refuses_passing_report_for_something_else(tmp_path: Path, tiny_digest: str, mismatch: dict,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A passing report for another checkpoint digest, k3verify version or device kind does not count."""
    write_report(tmp_path, **({"digest": tiny_digest} | mismatch))
    err = refusal(capsys, "--report-dir", str(tmp_path))
    assert f"no report for checkpoint {tiny_digest}" in err and "1 report(s) for other " in err


def test_passing_report_is_found_recursively(tmp_path: Path, tiny_digest: str) -> None:
    """A passing report nested anywhere under --report-dir lets the gate open; the newest one (by its run's start,
    read from inside the hashed report, not by when the index says it was written) is chosen."""
    newest = write_report(tmp_path / "a" / "b", digest=tiny_digest, started_at=ago(60))
    write_report(tmp_path / "c", digest=tiny_digest, started_at=ago(3600))
    gated = serve.require_gate(serve_args("--report-dir", str(tmp_path)))
    assert gated.report == newest and gated.target.digest == tiny_digest and gated.target.name == "k3-tiny"
    assert find_passing_report(tmp_path, want(tiny_digest)) == newest
    assert find_passing_report(tmp_path, want(tiny_digest, "cuda")) is None


def test_run_narrowed_by_only_never_opens_the_gate(tmp_path: Path, tiny_digest: str) -> None:
    """A green `parity --only gates.selftest` run proves nothing about the model: serve ignores it."""
    write_report(tmp_path / "narrow", digest=tiny_digest, only=["gates.selftest"])
    assert find_passing_report(tmp_path, want(tiny_digest)) is None
    with pytest.raises(UsageError, match=r"1 report\(s\) for runs narrowed by --only"):
        serve.require_gate(serve_args("--report-dir", str(tmp_path)))
    full = write_report(tmp_path / "full", digest=tiny_digest, started_at=ago(86400))
    assert find_passing_report(tmp_path, want(tiny_digest)) == full


def test_newer_failing_report_shadows_older_pass(tmp_path: Path, tiny_digest: str) -> None:
    """A regression recorded after a green run closes the gate again."""
    write_report(tmp_path / "old", digest=tiny_digest, started_at=ago(3600))
    write_report(tmp_path / "new", digest=tiny_digest, verdict="fail", started_at=ago(60))
    assert find_passing_report(tmp_path, want(tiny_digest)) is None
    with pytest.raises(UsageError, match="verdict 'fail'"):
        serve.require_gate(serve_args("--report-dir", str(tmp_path)))


def test_corrupt_report_is_ignored_with_a_warning(tmp_path: Path, tiny_digest: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Half-written and schema-invalid files outside any report index are skipped, each named in a warning; a valid
    pass still counts."""
    half = tmp_path / "half" / "report.json"
    half.parent.mkdir()
    half.write_text('{"schema_version": 1, "run": {"k3verify_ver', encoding="utf-8")
    invalid = tmp_path / "invalid" / "report.json"
    invalid.parent.mkdir()
    invalid.write_text(json.dumps({"schema_version": 1, "summary": {"verdict": "pass"}}), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="k3verify.gates.trust.lookup"):
        assert lookup_report(tmp_path, want(tiny_digest)).passing is None
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(half) in warned and str(invalid) in warned
    good = write_report(tmp_path / "good", digest=tiny_digest)
    found = lookup_report(tmp_path, want(tiny_digest))
    assert found.passing == good and set(found.skipped) == {half, invalid}


def test_run_gates_calls_parity_then_rechecks(tmp_path: Path, tiny_digest: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--run-gates runs the quick parity suite for this checkpoint/report dir and serves only if it passed."""
    from k3verify.commands import parity

    calls: list[argparse.Namespace] = []

    def fake_parity(verdict: str):  # type: ignore[no-untyped-def]
        def run(args: argparse.Namespace) -> int:
            calls.append(args)
            write_report(Path(args.report_dir), digest=tiny_digest, verdict=verdict)
            return 0 if verdict == "pass" else 1
        return run

    monkeypatch.setattr(parity, "run_parity", fake_parity("fail"))
    with pytest.raises(UsageError, match="gates did not pass .parity exit code 1"):
        serve.require_gate(serve_args("--report-dir", str(tmp_path), "--run-gates"))
    monkeypatch.setattr(parity, "run_parity", fake_parity("pass"))
    target = serve.require_gate(serve_args("--report-dir", str(tmp_path / "second"), "--run-gates"))
    assert target.report == tmp_path / "second" / "report.json"
    assert [(a.preset, a.suite, a.device, a.report_dir) for a in calls] == [
        ("k3-tiny", "quick", "cpu", tmp_path), ("k3-tiny", "quick", "cpu", tmp_path / "second")]


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--preset", "k3"], "is a real shape with no data"),
    (["--checkpoint", "/nonexistent/ckpt"], "no config.json"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--api-key", "abc12345 "], "--api-key has whitespace at its start or end (0 leading, 1 trailing): a client's "
                                 "bearer token cannot carry it, so no client could authenticate; remove it"),
    (["--api-key", "\tabc12345"], "--api-key has whitespace at its start or end (1 leading, 0 trailing)"),
    (["--api-key", "abc\u00e912345"], "--api-key holds characters outside printable ASCII"),
    (["--nonfinite-threshold", "0"], "max_nonfinite >= 1"),
    (["--admit-quiet-ms", "-1"], "--admit-quiet-ms and --admit-max-hold-ms must be >= 0"),
])
def test_bad_serve_arguments_are_usage_errors(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Bad flags fail before anything loads, with exit 2 and the value named."""
    assert message in refusal(capsys, *argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serve_process(*argv: str) -> Iterator[subprocess.Popen[str]]:
    """`k3verify serve` in a child process, stopped on the way out whatever the test asserted."""
    code = "from k3verify.cli import main; raise SystemExit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(20)


def _wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"serve did not become healthy within {timeout} s")


def _chat(url: str) -> None:
    body = {"model": "k3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 401


def test_serve_starts_behind_a_passing_report(tmp_path: Path, tiny_digest: str) -> None:
    """`k3verify serve` with a matching passing report loads the checkpoint (its own tokenizer, bf16) and serves."""
    write_report(tmp_path, digest=tiny_digest)
    port = _free_port()
    with _serve_process("--report-dir", str(tmp_path), "--port", str(port), "--api-key", "k") as proc:
        _wait_healthy(proc, f"http://127.0.0.1:{port}", 60)
        _chat(f"http://127.0.0.1:{port}")
        proc.terminate()  # SIGTERM: the engine's process stops its API process on the way out, and exits 0
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/v1" in out and "in its own process" in out, out
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.slow
def test_run_gates_writes_a_real_report_then_serves(tmp_path: Path) -> None:
    """--run-gates runs the real quick parity suite into an empty report dir, finds its report, and serves."""
    port = _free_port()
    with _serve_process("--report-dir", str(tmp_path), "--port", str(port), "--api-key", "k", "--run-gates") as proc:
        _wait_healthy(proc, f"http://127.0.0.1:{port}", 240)
        assert find_passing_report(tmp_path, want(serve.target_for(serve_args()).digest))
        _chat(f"http://127.0.0.1:{port}")


def test_served_engine_stops_at_config_and_generation_eos(tmp_path: Path, tiny_digest: str) -> None:
    """The engine `serve` builds stops at both [EOS] (config.json) and <|im_end|> (generation_config.json)."""
    write_report(tmp_path, digest=tiny_digest)
    args = serve_args("--report-dir", str(tmp_path), "--max-batch", "3")
    engine, tokenizer = serve.build_engine(args, serve.require_gate(args))
    assert engine.eos_token_ids == {tokenizer.eos_id, tokenizer.im_end_id} == {4097, 4098}
    assert engine.runner.state_pool.num_slots == 3
    assert Path(tokenizer.source).parent == serve.target_for(args).checkpoint_dir


def test_serve_on_a_port_in_use_is_a_usage_error(tmp_path: Path, tiny_digest: str) -> None:
    """The API process cannot bind: serve exits 2 naming the address and the reason, and leaves no process."""
    write_report(tmp_path, digest=tiny_digest)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with _serve_process("--report-dir", str(tmp_path), "--port", str(port)) as proc:
            out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2, out
    assert f"cannot serve on 127.0.0.1:{port}" in out and "Address already in use" in out, out
