"""The HTTP server in a process of its own (api/engine_link.py): what crosses the link arrives whole and in
order, refusals on either side reach the client, /metrics joins both sides once, and neither process outlives
the other's link; a supervised front end outlives its engine and reconnects. The shared server tests run over the
link too (conftest's tiny_server, test_server_health)."""

from __future__ import annotations

import dataclasses
import functools
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import pytest
from server_harness import TINY, RecordingRunner, make_tiny_runner, offline_greedy, running_server, tiny_parts

from k3verify.api.engine_link import ApiProcess, EngineHello, EngineHost, api_config, engine_state
from k3verify.api.remote_engine import RemoteEngine
from k3verify.serving.engine import Engine, EngineDeadError, EngineEvent
from k3verify.serving.sampler import SamplingParams
from k3verify.tokenizer import KimiTokenizer, default_tokenizer


def _engine() -> Engine:
    cfg, _, tok = tiny_parts()
    return Engine(RecordingRunner(make_tiny_runner()), tok, eos_token_ids=cfg.eos_token_ids,
                  vocab_size=cfg.vocab_size).start()


def _linked(engine: Engine) -> tuple[EngineHost, RemoteEngine]:
    """Both ends in this process, over a pipe: the link's logic without the API process."""
    ours, theirs = Pipe()
    host = EngineHost(engine, ours, lambda: b"").start()
    remote = RemoteEngine(theirs, engine.limits, engine_state(engine), tiny_parts()[2]).start()
    return host, remote


def _collect(remote: RemoteEngine, prompt: list[int], params: SamplingParams) -> tuple[list[EngineEvent], int]:
    events: list[EngineEvent] = []
    done = threading.Event()

    def sink(ev: EngineEvent) -> None:
        events.append(ev)
        if ev.finished:
            done.set()

    rid = remote.submit(prompt, params, sink)
    assert done.wait(60), f"request {rid} did not finish over the link"
    return events, rid


def test_link_delivers_every_token_in_order_for_concurrent_requests() -> None:
    """Four greedy requests at once over the link: each one's ids equal offline greedy generation of its prompt,
    one event per token, the last one finished. The prompts' answers differ, so a mix-up of requests would show."""
    prompts = [[1, 2, 3], [7, 8, 9, 10], [42], [5, 5, 5, 5, 5]]
    want, _ = offline_greedy(prompts, 6)
    assert len({tuple(w) for w in want}) == len(want)
    engine = _engine()
    host, remote = _linked(engine)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        results: dict[int, list[EngineEvent]] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _collect(remote, prompts[i], params)[0]))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, events in results.items():
            assert [t for ev in events for t in ev.token_ids] == want[i], f"prompt {i}"
            assert [ev.finished for ev in events] == [False] * 5 + [True] and events[-1].finish_reason == "length"
        assert sorted(results) == list(range(len(prompts)))
    finally:
        host.close()
        engine.stop()


def test_refusal_on_the_engine_side_reaches_the_sink() -> None:
    """The engine stopped after the API side's last state: its submit is refused over there, and the request
    ends with an engine_unavailable error event instead of waiting forever."""
    engine = _engine()
    host, remote = _linked(engine)
    try:
        engine.stop()
        for _ in range(200):  # the stop reaches the API side as a state message ...
            if remote.health() is not None:
                break
            threading.Event().wait(0.01)
        assert remote.health() == "engine stopped"
        remote._state = dataclasses.replace(remote._state, health=None)  # ... which we make it miss
        events, _ = _collect(remote, [1, 2, 3], SamplingParams(max_tokens=2))
        assert len(events) == 1 and events[0].code == "engine_unavailable" and "not running" in str(events[0].error)
        assert not host._ended_early and not host._seq, "a refused request leaves nothing behind on the engine side"
    finally:
        host.close()


def test_requests_are_checked_on_the_api_side_with_the_engines_limits() -> None:
    """Too long, bad ids: refused by the RemoteEngine with the Engine's own errors, before anything is sent."""
    engine = _engine()
    host, remote = _linked(engine)
    try:
        for prompt, tokens in (([1] * 10, engine.limits.max_context), ([engine.vocab_size], 2), ([], 2)):
            with pytest.raises(ValueError) as local:
                remote.submit(prompt, SamplingParams(max_tokens=tokens), lambda ev: None)
            with pytest.raises(ValueError) as there:
                engine.submit(prompt, SamplingParams(max_tokens=tokens), lambda ev: None)
            assert type(local.value) is type(there.value) and str(local.value) == str(there.value)
        assert remote.max_new_tokens_for(10) == engine.max_new_tokens_for(10) > 0
        assert engine.num_submitted == 0
    finally:
        host.close()
        engine.stop()


def test_metrics_join_both_sides_once_and_health_follows_the_engine() -> None:
    """/metrics from the API process: the app's request counters and the engine's latency histograms, each family
    once; /health reports the engine's state, and 503 once the engine is gone."""
    with running_server(api_process=True) as server:
        body = {"model": TINY, "prompt": "hello", "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        for family in ("k3v_requests_total", "k3v_generation_tokens_total", "k3v_time_to_first_token_seconds",
                       "k3v_inter_token_latency_seconds", "k3v_queue_depth"):
            assert text.count(f"# TYPE {family} ") == 1, family
        assert "k3v_inter_token_latency_seconds_count 2.0" in text
        assert httpx.get(f"{server.url}/health", timeout=5).json()["status"] == "ok"
        server.engine.stop()
        deadline = threading.Event()
        for _ in range(50):
            r = httpx.get(f"{server.url}/health", timeout=5)
            if r.status_code == 503:
                break
            deadline.wait(0.05)
        assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
        late = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"


def test_api_process_exits_when_the_engine_side_closes_the_link() -> None:
    """An API server without its engine must not keep the port open: closing the link ends the process."""
    with running_server(api_process=True) as server:
        assert server.api is not None and server.api.proc is not None and server.api.host_link is not None
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        server.api.host_link.close()
        assert server.api.proc.wait(20) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=2)


def test_api_process_that_cannot_start_names_why(tmp_path: Path) -> None:
    """A tokenizer the API process cannot load: the engine's side raises with the child's reason."""
    engine = _engine()
    try:
        loader = functools.partial(KimiTokenizer.from_dir, tmp_path / "no-such-checkpoint")
        with pytest.raises(RuntimeError, match="could not start.*no-such-checkpoint"):
            with ApiProcess(engine, api_config(engine, loader, TINY), lambda: b""):
                pass
    finally:
        engine.stop()


def test_api_process_imports_the_engines_package_whatever_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A k3verify folder in the working directory (another checkout) is not what the API process runs."""
    (tmp_path / "k3verify").mkdir()
    (tmp_path / "k3verify" / "__init__.py").write_text("raise ImportError('the wrong k3verify')\n")
    monkeypatch.chdir(tmp_path)
    with running_server(api_process=True) as server:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_remote_engine_fails_in_flight_requests_then_reconnects_to_the_same_checkpoint() -> None:
    """The engine side's link dies with a request in flight: its sink gets an engine_unavailable error event and new
    requests are refused while the link is down; the front end then connects to the next engine (same digest) and
    serves again. A next engine with another digest is refused and the front end told to stop."""
    engine = _engine()
    hosts: list[EngineHost] = []
    digests = ["sha256:a", "sha256:a", "sha256:b"]

    def connect() -> tuple[Connection, EngineHello]:
        ours, theirs = Pipe()
        hello = EngineHello(engine.limits, engine_state(engine), default_tokenizer, digests.pop(0))
        hosts.append(EngineHost(engine, ours, lambda: b"", hello).start())
        return theirs, theirs.recv()[1]

    lost = threading.Event()
    conn, hello = connect()
    remote = RemoteEngine(conn, hello.limits, hello.state, tiny_parts()[2], on_lost=lost.set, reconnect=connect,
                          digest=hello.digest).start()
    try:
        events: list[EngineEvent] = []
        done = threading.Event()
        longest = engine.max_new_tokens_for(3)  # ~30 s of decoding here: it must be aborted, not finish
        remote.submit([1, 2, 3], SamplingParams(max_tokens=longest, ignore_eos=True),
                      lambda ev: (events.append(ev), ev.finished and done.set()))
        for _ in range(200):  # decoding: its tokens arrive
            if events:
                break
            threading.Event().wait(0.05)
        assert events and engine.num_running == 1, "the request never started: the abort below would prove nothing"
        hosts[0].close()
        assert done.wait(10) and events[-1].code == "engine_unavailable", events[-1:]
        for _ in range(100):  # the engine side aborts what the lost link had submitted
            if engine.num_running == engine.num_waiting == 0:
                break
            threading.Event().wait(0.05)
        assert engine.num_running == engine.num_waiting == 0, "the dead link's request still runs"
        for _ in range(100):
            if remote.health() is None:
                break
            threading.Event().wait(0.05)
        assert remote.health() is None and len(hosts) == 2, remote.health()
        got, _ = _collect(remote, [1, 2, 3], SamplingParams(max_tokens=3))
        assert got[-1].finish_reason == "length"
        hosts[1].close()
        assert lost.wait(10) and "serves checkpoint sha256:b, not sha256:a" in str(remote.health())
        with pytest.raises(EngineDeadError):
            remote.submit([1], SamplingParams(max_tokens=1), lambda ev: None)
    finally:
        remote.close()
        for host in hosts:
            host.close()
        engine.stop()
