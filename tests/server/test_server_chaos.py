"""The traffic phase of scripts/chaos.py against k3-tiny: fuzz, poison requests, hang-ups and one injected engine
fault; nothing lost, no 5xx outside the fault, one restart, healthy and clean after (the gate phase, which runs
the real quick parity suite, is exercised by running the script itself)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from server_harness import TINY, RecordingRunner, make_tiny_runner, running_server

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_chaos():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(SCRIPTS))  # chaos.py imports its sibling load_test.py
    spec = importlib.util.spec_from_file_location("k3v_chaos", SCRIPTS / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_chaos_traffic_loses_nothing_and_restarts_once() -> None:
    """120 mixed requests from 12 clients with the fault injected halfway: every accepted request gets a final
    answer, 5xx only at the fault, exactly one restart, and the engine ends healthy with clean caches."""
    chaos_mod = load_chaos()
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
