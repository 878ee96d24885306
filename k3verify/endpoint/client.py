"""A polite HTTP client for one OpenAI-compatible server: bounded concurrency, a request budget, a total deadline
per request and per run, a cap on each answer's size (endpoint/transfer.py), and retries with backoff on 429/503
(honouring Retry-After). Never sends more requests than it was allowed; never follows a redirect.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from k3verify.endpoint.transfer import (
    DEFAULT_MAX_RESPONSE_BYTES,
    Deadline,
    EndpointError,
    EndpointTimeout,
    exchange,
)

RETRY_STATUSES = (429, 503)
MAX_RETRY_AFTER_S = 30.0
RECORDED_HEADERS = ("server", "x-powered-by", "x-request-id", "openai-version", "openai-processing-ms")


class BudgetExceeded(EndpointError):
    """The run would send more requests than --max-requests allows."""


@dataclass(frozen=True)
class Limits:
    """What the user allows: requests in flight at once, requests in total (retries count), the total time one
    request may take (connect, retries and the whole body), the total time of the run's traffic, the largest
    response body read, retries on 429/503 and the first backoff delay (doubled per retry, with jitter)."""

    concurrency: int = 4
    max_requests: int = 400
    timeout_s: float = 120.0
    run_timeout_s: float = 3600.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    retries: int = 4
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_requests", "max_response_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        finite = all(math.isfinite(v) for v in (self.timeout_s, self.run_timeout_s, self.backoff_s))
        if not finite or self.retries < 0 or self.timeout_s <= 0 or self.run_timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"retries >= 0, finite timeout_s > 0, run_timeout_s > 0 and backoff_s >= 0 required; "
                             f"got {self}")


@dataclass
class Reply:
    """One HTTP answer: status, parsed JSON body (None if empty), selected headers, attempts it took, and where a
    redirect pointed (redirects are never followed: the URL given is the server verified)."""

    status: int
    body: Any
    headers: dict[str, str]
    attempts: int = 1
    location: str | None = None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def error_message(self) -> str:
        """The server's error message in any of the envelopes in use: OpenAI's {"error": {...}} and
        vLLM/SGLang's older flat {"object": "error", "message": ...}; else the raw body."""
        body = self.body
        if 300 <= self.status < 400:
            return (f"{self.status}: a redirect to {str(self.location)[:200]!r}, which is not followed (give the URL "
                    "of the server itself)")
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
    """Thread-safe; every request goes through one semaphore (concurrency) and one counter (budget), and ends by
    its deadline (endpoint/transfer.py) whatever the server does."""

    def __init__(self, url: str, *, api_key: str | None = None, limits: Limits | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.root = server_root(url)
        self.limits = limits or Limits()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.root, headers=headers, timeout=self.limits.timeout_s,
                                  transport=transport, follow_redirects=False)
        self._slots = threading.BoundedSemaphore(self.limits.concurrency)
        self._lock = threading.Lock()
        self._run_deadline = time.monotonic() + self.limits.run_timeout_s
        self.stats = Stats()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EndpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, path: str) -> Reply:
        return self._send("GET", path, None, stream=False)[0]

    def post(self, path: str, body: Mapping[str, Any]) -> Reply:
        return self._send("POST", path, body, stream=False)[0]

    def stream(self, path: str, body: Mapping[str, Any]) -> tuple[Reply, list[dict[str, Any]]]:
        """POST with SSE: (reply, the events' JSON payloads up to `data: [DONE]`). A non-2xx reply has no events."""
        return self._send("POST", path, body, stream=True)

    def _deadline(self, what: str) -> Deadline:
        """This request's deadline: --timeout from now, or the run's (--run-timeout) if that comes first."""
        now = time.monotonic()
        if now >= self._run_deadline:
            raise EndpointTimeout(f"{what}: not sent, the run's deadline of {self.limits.run_timeout_s:g} s "
                                  "(--run-timeout) has passed")
        if self._run_deadline < now + self.limits.timeout_s:
            return Deadline(self._run_deadline, self.limits.run_timeout_s, "the run's deadline (--run-timeout)")
        return Deadline(now + self.limits.timeout_s, self.limits.timeout_s, "the per-request deadline (--timeout)")

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None, *,
              stream: bool) -> tuple[Reply, list[dict[str, Any]]]:
        what = f"{method} {self.root}{path}" + (" (stream)" if stream else "")
        deadline = self._deadline(what)
        for attempt in range(self.limits.retries + 1):
            self._spend()
            with self._slots:
                got = exchange(self._http, method, path, body, stream=stream, deadline=deadline,
                               max_bytes=self.limits.max_response_bytes, what=what)
            self._count(got.status)
            reply = Reply(got.status, got.body, _recorded(got.headers), attempt + 1, got.headers.get("location"))
            if got.status not in RETRY_STATUSES or attempt == self.limits.retries:
                return reply, got.events
            delay = self._delay(got.headers.get("retry-after"), attempt)
            if time.monotonic() + delay >= deadline.at:
                raise EndpointTimeout(f"{what}: answered {got.status} and asked to retry after {delay:.3g} s, past "
                                      f"{deadline.what} of {deadline.seconds:g} s")
            time.sleep(delay)
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

    def _delay(self, after: str | None, attempt: int) -> float:
        """Retry-After (seconds) when the server sends one, else exponential backoff with jitter."""
        with self._lock:
            self.stats.retried += 1
        if after is not None:
            try:
                value = float(after)
            except ValueError:
                value = math.nan  # an HTTP-date: fall back to our own backoff
            if math.isfinite(value):
                return min(max(value, 0.0), MAX_RETRY_AFTER_S)
        base = self.limits.backoff_s * (2 ** attempt)
        return min(base * (1.0 + 0.25 * random.random()), MAX_RETRY_AFTER_S)


def _recorded(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: headers[k] for k in RECORDED_HEADERS if k in headers}
