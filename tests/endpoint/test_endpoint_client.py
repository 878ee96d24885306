"""The endpoint client is bounded and polite: retries with backoff only on 429/503 (Retry-After honoured), a hard
request budget, a concurrency cap, and loud failures for broken streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from k3verify.endpoint.client import BudgetExceeded, EndpointClient, EndpointError, Limits, server_root


def client(handler: Callable[[httpx.Request], httpx.Response], **limits: Any) -> EndpointClient:
    return EndpointClient("http://server/v1", transport=httpx.MockTransport(handler),
                          limits=Limits(**{"backoff_s": 0.0, **limits}))


def counting(calls: list[httpx.Request], status: int) -> Callable[[httpx.Request], httpx.Response]:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(status, json={})
    return handle


def answering(text: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(200, text=text)


def test_retries_429_and_503_honouring_retry_after_then_succeeds() -> None:
    """Two refusals then an answer: three attempts, the Retry-After delay waited, two retries counted."""
    answers = iter([httpx.Response(429, headers={"retry-after": "0.2"}, json={}), httpx.Response(503, json={}),
                    httpx.Response(200, json={"ok": True})])
    c = client(lambda request: next(answers))
    start = time.perf_counter()
    reply = c.post("/v1/completions", {})
    assert reply.ok and reply.attempts == 3 and reply.body == {"ok": True}
    assert time.perf_counter() - start >= 0.2
    assert c.stats.sent == 3 and c.stats.retried == 2 and c.stats.by_status == {"429": 1, "503": 1, "200": 1}


def test_other_errors_are_not_retried_and_retries_are_bounded() -> None:
    """A 400 is answered at once; a server that keeps answering 503 gets 1 + retries attempts, then its 503."""
    c = client(lambda request: httpx.Response(400, json={"error": {"message": "bad"}}))
    assert c.post("/x", {}).attempts == 1
    calls: list[httpx.Request] = []
    c = client(counting(calls, 503), retries=2)
    reply = c.post("/x", {})
    assert reply.status == 503 and len(calls) == 3


def test_request_budget_is_never_exceeded() -> None:
    """With --max-requests 3, the fourth request (retries count) raises and is not sent."""
    calls: list[httpx.Request] = []
    c = client(counting(calls, 200), max_requests=3)
    for _ in range(3):
        c.get("/v1/models")
    with pytest.raises(BudgetExceeded, match="budget of 3"):
        c.get("/v1/models")
    assert len(calls) == 3


def test_concurrency_cap_holds_under_many_threads() -> None:
    """16 threads through a client capped at 2 in flight: the server never sees more than 2 at once."""
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.02)
        with lock:
            state["now"] -= 1
        return httpx.Response(200, json={})

    c = client(handler, concurrency=2)
    with ThreadPoolExecutor(16) as pool:
        assert all(r.ok for r in pool.map(lambda _: c.get("/x"), range(16)))
    assert state["peak"] == 2


def test_stream_without_done_or_with_bad_json_is_an_error() -> None:
    """A stream cut before `data: [DONE]`, or carrying a non-JSON event, raises instead of parsing half an answer."""
    for text, message in (("data: {\"a\": 1}\n\n", "without `data: \\[DONE\\]`"), ("data: {oops\n\n", "not JSON")):
        c = client(answering(text))
        with pytest.raises(EndpointError, match=message):
            c.stream("/v1/completions", {})


def test_stream_retries_503_then_reads_events() -> None:
    answers = iter([httpx.Response(503, json={}), httpx.Response(200, text='data: {"a": 1}\n\ndata: [DONE]\n\n')])
    reply, events = client(lambda request: next(answers)).stream("/v1/completions", {})
    assert reply.attempts == 2 and events == [{"a": 1}]


@pytest.mark.parametrize(("url", "root"), [("http://h:1", "http://h:1"), ("http://h:1/", "http://h:1"),
                                           ("https://h/v1/", "https://h")])
def test_server_root_accepts_what_users_type(url: str, root: str) -> None:
    assert server_root(url) == root


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="concurrency must be >= 1; got 0"):
        Limits(concurrency=0)
