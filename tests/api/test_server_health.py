"""An engine fault fails the requests in flight and the supervisor restarts the loop; an engine that keeps
failing or stalls turns /health red; pending requests get an error, never a hang; a client that goes away
has its cache released."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_harness import TINY, RecordingRunner, make_tiny_runner, running_server

from k3verify.serving.health import HealthPolicy


@pytest.fixture(params=[False, True], ids=["in_process", "api_process"])
def api_process(request: pytest.FixtureRequest) -> bool:
    """Each test twice: the app in the engine's process, and in a process of its own (api/engine_link.py)."""
    return bool(request.param)


BODY = {"model": TINY, "prompt": "hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def SlowRunner(delay_s: float, gate: threading.Event | None = None, **kw: object) -> RecordingRunner:  # noqa: N802
    """The k3-tiny runner with every step slowed by delay_s (so requests stay in flight), optionally gated."""
    return RecordingRunner(make_tiny_runner(**kw), delay_s=delay_s, gate=gate)


def wait_until(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_engine_fault_fails_in_flight_request_then_engine_restarts(api_process: bool) -> None:
    """A runner exception mid-request: that request gets a 503 naming the fault; the supervisor restarts the loop
    with fresh caches, /health is 200 "degraded" counting the restart, /metrics counts it, the next request is
    served and the caches are clean."""
    runner = SlowRunner(0.01)
    with running_server(runner, api_process=api_process) as server:
        assert httpx.get(f"{server.url}/health", timeout=5).json()["status"] == "ok"
        results: list[httpx.Response] = []
        inflight = threading.Thread(target=lambda: results.append(
            httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30)))
        inflight.start()
        assert wait_until(lambda: server.engine.num_running == 1)
        runner.fail_next = RuntimeError("injected decode fault")
        inflight.join(15)
        assert not inflight.is_alive(), "the in-flight request hung after the engine fault"
        r = results[0]
        assert r.status_code == 503 and "injected decode fault" in r.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert health.json()["restarts"] == 1 and "injected decode fault" in " ".join(health.json()["reasons"])
        assert "k3v_engine_restarts_total 1.0" in httpx.get(f"{server.url}/metrics", timeout=5).text
        late = httpx.post(f"{server.url}/v1/completions", json=BODY | {"max_tokens": 3}, timeout=30)
        assert late.status_code == 200 and late.json()["usage"]["completion_tokens"] == 3
        server.engine.check_integrity()
        runner.assert_empty()


def test_engine_that_keeps_failing_is_given_up(api_process: bool) -> None:
    """Past max_restarts faults in the window the loop stays dead: /health 503 and new requests 503."""
    runner = SlowRunner(0.0)
    with running_server(runner, api_process=api_process, health_policy=HealthPolicy(max_restarts=1)) as server:
        for _ in range(2):
            server.engine.inject_fault("fault again")
            r = httpx.post(f"{server.url}/v1/completions", json=BODY | {"max_tokens": 3}, timeout=30)
            assert r.status_code == 503 and "fault again" in r.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and "gave up" in health.json()["error"]["message"]
        late = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"


def test_engine_fault_mid_stream_sends_error_event_then_done(api_process: bool) -> None:
    """A stream in flight when the engine dies ends with an SSE error event and [DONE], not a hang."""
    runner = SlowRunner(0.01)
    with running_server(runner, api_process=api_process) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=BODY | {"stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln)
            assert json.loads(first[6:])["choices"][0]["text"] is not None
            runner.fail_next = RuntimeError("boom mid-stream")
            rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]"
        errors = [json.loads(ln[6:]) for ln in rest[:-1] if "error" in json.loads(ln[6:])]
        assert len(errors) == 1 and "boom mid-stream" in errors[0]["error"]["message"]


def test_stalled_engine_turns_health_red(api_process: bool) -> None:
    """A step that makes no progress past stall_timeout_s makes /health 503 while the engine is stuck."""
    gate = threading.Event()
    with running_server(SlowRunner(0.0, gate), api_process=api_process, stall_timeout_s=0.3) as server:
        sender = threading.Thread(target=lambda: httpx.post(f"{server.url}/v1/completions",
                                                            json=BODY | {"max_tokens": 3}, timeout=30))
        sender.start()
        try:
            assert wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503, 10)
            assert "stalled" in httpx.get(f"{server.url}/health", timeout=5).json()["error"]["message"]
        finally:
            gate.set()
        sender.join(15)
        assert wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 200, 10)


def test_stream_disconnect_releases_cache(api_process: bool) -> None:
    """Closing a stream mid-generation aborts the request: its slot and pages are free within seconds."""
    runner = SlowRunner(0.02)  # 200 tokens would take 4 s
    with running_server(runner, api_process=api_process) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=BODY | {"stream": True}, timeout=30) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += bool(line)
                if chunks == 3:
                    break
        assert runner.active_ids, "the request finished before the disconnect: the test proved nothing"
        assert wait_until(lambda: not runner.active_ids and server.engine.num_running == 0, 2.5), runner.active_ids
        assert server.engine.num_steps < 150, "released only by finishing, not by the abort"
        runner.assert_empty()


def test_non_stream_disconnect_releases_cache(api_process: bool) -> None:
    """A non-streaming client that times out and hangs up has its request aborted too."""
    runner = SlowRunner(0.02)  # 400 tokens would take 8 s
    with running_server(runner, api_process=api_process) as server:
        try:
            httpx.post(f"{server.url}/v1/completions", json=BODY | {"max_tokens": 400}, timeout=0.3)
            raise AssertionError("the request finished before the client timed out")
        except httpx.ReadTimeout:
            pass
        assert wait_until(lambda: not runner.active_ids, 3), runner.active_ids
        assert server.engine.num_steps < 200, "released only by finishing, not by the abort"
        runner.assert_empty()


def test_waiting_request_is_admitted_when_pages_free(api_process: bool) -> None:
    """A request that fits only once another finishes waits (no 400, no error) and is then served."""
    runner = SlowRunner(0.0, num_pages=9, page_size=16)  # 8 usable pages = 128 tokens of cache
    with running_server(runner, api_process=api_process) as server:
        body = BODY | {"max_tokens": 70}  # prompt + 70 tokens = 5 pages: two cannot fit at once
        out: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: out.append(
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in out] == [200, 200]
        assert runner.max_batch_seen == 1
        assert out[0].json()["choices"][0]["text"] == out[1].json()["choices"][0]["text"]
