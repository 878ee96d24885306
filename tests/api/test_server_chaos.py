"""tools/chaos.py against k3-tiny: its traffic phase (fuzz, poison requests, hang-ups and one injected engine
fault; nothing lost, no 5xx outside the fault, one restart, healthy and clean after) and its kill phase (kill -9 of
a supervised `serve`'s engine process and of its HTTP front end under 64 clients). The gate phase, which runs the
real quick parity suite, is exercised by running the script itself."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from gate_reports import write_report
from server_harness import TINY, RecordingRunner, make_tiny_runner, running_server

from k3verify.target import resolve_target
from tools import chaos as chaos_mod
from tools import chaos_kill


def test_chaos_traffic_loses_nothing_and_restarts_once() -> None:
    """120 mixed requests from 12 clients with the fault injected halfway: every accepted request gets a final
    answer, 5xx only at the fault, exactly one restart, and the engine ends healthy with clean caches."""
    runner = RecordingRunner(make_tiny_runner(num_slots=8))
    with running_server(runner) as server:
        chaos = chaos_mod.Chaos()
        summary = chaos_mod.run_traffic(server.url, server.engine, TINY,
                                        chaos_mod.parse_args(["--requests", "120", "--clients", "12"]), chaos)
        runner.assert_empty()
    assert not chaos.failures, (summary, chaos.failures[:5])
    kinds = {o.kind for o in chaos.outcomes}
    assert kinds == {"good", "fuzz", "poison", "hangup", "timeout"}, kinds
    assert "lost 0" in summary and "engine restarts 1" in summary
    assert any(chaos_mod.FAULT in o.error for o in chaos.outcomes), "the fault hit no request: proves nothing"
    assert sum(o.status == 200 for o in chaos.outcomes) > 30 and sum(o.hung_up for o in chaos.outcomes) > 5


def test_kill_9_of_the_engine_or_the_front_end_leaves_no_client_without_an_answer(tmp_path: Path) -> None:
    """Supervised `serve` of k3-tiny, 64 streaming clients (plus 16 plain ones) each time: kill -9 of the engine's
    process leaves 0 connections closed without an answer (stream error events, 503 with Retry-After) and the engine
    is restarted;
    kill -9 of the HTTP front end keeps the engine's process (same pid), the front end is back within 10 s, requests
    sent while it was down are answered, and the dead clients' requests are freed."""
    kill = chaos_kill
    write_report(tmp_path / "reports", digest=resolve_target(TINY).digest)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = kill.ServeProcess("--report-dir", str(tmp_path / "reports"), port=port)
    try:
        server.wait_healthy(120)
        engine = kill.kill_engine(server, TINY, 64)
        front = kill.kill_front_end(server, TINY, 64)
    finally:
        rc = server.stop()
    print("\n".join(engine.notes + front.notes))
    assert not engine.failures, (engine.notes, engine.failures[:5], server.log())
    assert len(engine.answers) == 80 and sum(a.streamed for a in engine.answers) == 64 and not engine.unanswered
    assert not front.failures, (front.notes, front.failures[:5], server.log())
    assert front.back_after_s <= kill.BACK_WITHIN_S
    assert rc == 0, server.log()


def test_the_supervisor_gives_up_past_max_restarts_naming_what_died(tmp_path: Path) -> None:
    """--max-restarts 1: the front end killed once is restarted; killed again within --health-window the supervisor
    stops the engine too and exits 1, naming the process and how it ended."""
    kill = chaos_kill
    write_report(tmp_path / "reports", digest=resolve_target(TINY).digest)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = kill.ServeProcess("--report-dir", str(tmp_path / "reports"), "--max-restarts", "1", "--health-window",
                               "120", port=port)
    try:
        server.wait_healthy(120)
        engine = server.pids["engine"]
        os.kill(server.pids["HTTP front end"], 9)
        server.wait_healthy(60)
        os.kill(server.pids["HTTP front end"], 9)
        assert server.proc.wait(60) == 1, server.log()
    finally:
        server.stop()
    assert "the HTTP front end process" in server.log() and "ended (signal SIGKILL)" in server.log()
    assert "restarted 1 time(s) within 120 s already: giving up" in server.log(), server.log()
    with pytest.raises(OSError):
        os.kill(engine, 0)  # the engine's process was stopped with it
