"""A polite HTTP client for one OpenAI-compatible server: bounded concurrency, a request budget, timeouts,
and retries with backoff on 429/503 (honouring Retry-After). Never sends more requests than it was allowed.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRY_STATUSES = (429, 503)
MAX_RETRY_AFTER_S = 30.0
RECORDED_HEADERS = ("server", "x-powered-by", "x-request-id", "openai-version", "openai-processing-ms")


class EndpointError(RuntimeError):
    """A request that got no usable answer: transport failure, timeout, or a non-JSON body."""


class BudgetExceeded(EndpointError):
    """The run would send more requests than --max-requests allows."""


@dataclass(frozen=True)
class Limits:
    """What the user allows: requests in flight at once, requests in total (retries count), per-request timeout,
    retries on 429/503 and the first backoff delay (doubled per retry, with jitter)."""

    concurrency: int = 4
    max_requests: int = 400
    timeout_s: float = 120.0
    retries: int = 4
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"retries >= 0, timeout_s > 0 and backoff_s >= 0 required; got {self}")


@dataclass
class Reply:
    """One HTTP answer: status, parsed JSON body (None if empty), selected headers, attempts it took."""

    status: int
    body: Any
    headers: dict[str, str]
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def error_message(self) -> str:
        """The server's error message in any of the envelopes in use: OpenAI's {"error": {...}} and
        vLLM/SGLang's older flat {"object": "error", "message": ...}; else the raw body."""
        body = self.body
        if isinstance(body, Mapping):
            inner = body.get("error")
            if isinstance(inner, Mapping) and "message" in inner:
                return f"{self.status}: {inner['message']}"
            if "message" in body:
                return f"{self.status}: {body['message']}"
            if isinstance(body.get("detail"), str):
                return f"{self.status}: {body['detail']}"
        return f"{self.status}: {str(body)[:300]}"


@dataclass
class Stats:
    sent: int = 0
    retried: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


def server_root(url: str) -> str:
    """The server root from what a user types: `http://h:p`, `http://h:p/`, `http://h:p/v1`."""
    root = url.strip().rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(f"endpoint URL must start with http:// or https://; got {url!r}")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class EndpointClient:
    """Thread-safe; every request goes through one semaphore (concurrency) and one counter (budget)."""

    def __init__(self, url: str, *, api_key: str | None = None, limits: Limits | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.root = server_root(url)
        self.limits = limits or Limits()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.root, headers=headers, timeout=self.limits.timeout_s,
                                  transport=transport)
        self._slots = threading.BoundedSemaphore(self.limits.concurrency)
        self._lock = threading.Lock()
        self.stats = Stats()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EndpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, path: str) -> Reply:
        return self._send("GET", path, None)

    def post(self, path: str, body: Mapping[str, Any]) -> Reply:
        return self._send("POST", path, body)

    def stream(self, path: str, body: Mapping[str, Any]) -> tuple[Reply, list[dict[str, Any]]]:
        """POST with SSE: (reply, the events' JSON payloads up to `data: [DONE]`). A non-2xx reply has no events."""
        for attempt in range(self.limits.retries + 1):
            self._spend()
            with self._slots:
                try:
                    with self._http.stream("POST", path, json=dict(body)) as resp:
                        if resp.status_code in RETRY_STATUSES and attempt < self.limits.retries:
                            resp.read()
                            delay = self._delay(resp, attempt)
                        else:
                            return self._stream_reply(resp, attempt + 1)
                except httpx.HTTPError as exc:
                    raise EndpointError(f"POST {self.root}{path} (stream): {type(exc).__name__}: {exc}") from exc
            time.sleep(delay)
        raise AssertionError("unreachable: the last attempt always returns")

    def _stream_reply(self, resp: httpx.Response, attempts: int) -> tuple[Reply, list[dict[str, Any]]]:
        self._count(resp.status_code)
        if not 200 <= resp.status_code < 300:
            resp.read()
            return Reply(resp.status_code, _json_or_text(resp), _headers(resp), attempts), []
        events = list(_sse_payloads(resp.iter_lines()))
        return Reply(resp.status_code, None, _headers(resp), attempts), events

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None) -> Reply:
        for attempt in range(self.limits.retries + 1):
            self._spend()
            with self._slots:
                try:
                    resp = self._http.request(method, path, json=None if body is None else dict(body))
                except httpx.HTTPError as exc:
                    raise EndpointError(f"{method} {self.root}{path}: {type(exc).__name__}: {exc}") from exc
            self._count(resp.status_code)
            if resp.status_code not in RETRY_STATUSES or attempt == self.limits.retries:
                return Reply(resp.status_code, _json_or_text(resp), _headers(resp), attempt + 1)
            time.sleep(self._delay(resp, attempt))
        raise AssertionError("unreachable: the last attempt always returns")

    def _spend(self) -> None:
        with self._lock:
            if self.stats.sent >= self.limits.max_requests:
                raise BudgetExceeded(f"request budget of {self.limits.max_requests} spent (--max-requests); "
                                     "nothing more is sent")
            self.stats.sent += 1

    def _count(self, status: int) -> None:
        with self._lock:
            self.stats.by_status[str(status)] = self.stats.by_status.get(str(status), 0) + 1

    def _delay(self, resp: httpx.Response, attempt: int) -> float:
        """Retry-After (seconds) when the server sends one, else exponential backoff with jitter."""
        with self._lock:
            self.stats.retried += 1
        after = resp.headers.get("retry-after")
        if after is not None:
            try:
                return min(max(float(after), 0.0), MAX_RETRY_AFTER_S)
            except ValueError:
                pass  # an HTTP-date: fall back to our own backoff
        base = self.limits.backoff_s * (2 ** attempt)
        return min(base * (1.0 + 0.25 * random.random()), MAX_RETRY_AFTER_S)


def _headers(resp: httpx.Response) -> dict[str, str]:
    return {k: resp.headers[k] for k in RECORDED_HEADERS if k in resp.headers}


def _json_or_text(resp: httpx.Response) -> Any:
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text[:2000]


def _sse_payloads(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """JSON payloads of `data:` lines until `data: [DONE]`; a payload that is not JSON is an EndpointError."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError as exc:
            raise EndpointError(f"stream event is not JSON: {data[:200]!r}") from exc
    raise EndpointError("stream ended without `data: [DONE]`")
