"""One HTTP exchange with a server that may be hostile: it ends by its deadline and reads at most a capped body.

httpx's `timeout` bounds each socket operation, not the exchange: a server that sends one byte every few seconds
keeps a read alive forever. Here the exchange runs in a daemon thread the caller waits for until the deadline and
then abandons (it stops at its next chunk, or at httpx's own timeout, set to the same deadline, if the server
stalls); the body is read in chunks and refused once it passes `max_bytes` (a declared Content-Length over it is
refused before any of it is read). A streamed answer is read up to its `data: [DONE]` line, so a stream that never
ends ends at the cap or the deadline, whichever comes first.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024
DONE = "[DONE]"


class EndpointError(RuntimeError):
    """A request that got no usable answer: transport failure, timeout, an oversized or malformed body."""


class EndpointTimeout(EndpointError):
    """A request (or the run) that did not finish by its deadline."""


@dataclass(frozen=True)
class Deadline:
    """When an exchange must have ended (time.monotonic()), the budget it came from and what set it."""

    at: float
    seconds: float
    what: str

    def left(self) -> float:
        return self.at - time.monotonic()


@dataclass
class Exchange:
    """What came back: status, headers (lower-case names), the body (parsed JSON, else its text, None if empty) and,
    for a 2xx stream, the JSON objects of its `data:` events up to `[DONE]`."""

    status: int
    headers: dict[str, str]
    body: Any
    events: list[dict[str, Any]] = field(default_factory=list)


def exchange(http: httpx.Client, method: str, path: str, body: Mapping[str, Any] | None, *, stream: bool,
             deadline: Deadline, max_bytes: int, what: str) -> Exchange:
    """Send one request and read its whole answer by `deadline`; EndpointTimeout when it does not end in time,
    EndpointError for a transport failure, an oversized body or a malformed stream."""
    box: dict[str, Any] = {}
    cancel = threading.Event()

    def work() -> None:
        try:
            box["out"] = _transfer(http, method, path, body, stream, deadline, max_bytes, what, cancel)
        except BaseException as exc:  # handed to the caller's thread, re-raised there
            box["exc"] = exc

    worker = threading.Thread(target=work, name="k3v-endpoint-exchange", daemon=True)
    worker.start()
    worker.join(max(deadline.left(), 0.0))
    if worker.is_alive():
        cancel.set()
        raise EndpointTimeout(f"{what}: no complete answer within {deadline.what} of {deadline.seconds:g} s")
    if "exc" in box:
        raise box["exc"]
    out: Exchange = box["out"]
    return out


def _transfer(http: httpx.Client, method: str, path: str, body: Mapping[str, Any] | None, stream: bool,
              deadline: Deadline, max_bytes: int, what: str, cancel: threading.Event) -> Exchange:
    left = deadline.left()
    if left <= 0:
        raise EndpointTimeout(f"{what}: {deadline.what} of {deadline.seconds:g} s passed before it was sent")
    try:
        with http.stream(method, path, json=None if body is None else dict(body), timeout=left) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items()}
            _check_declared_length(headers, max_bytes, what)
            chunks = _capped(resp.iter_bytes(), max_bytes, what, cancel)
            if stream and 200 <= resp.status_code < 300:
                return Exchange(resp.status_code, headers, None, list(_sse_events(chunks, what)))
            return Exchange(resp.status_code, headers, _json_or_text(b"".join(chunks)))
    except httpx.HTTPError as exc:
        if cancel.is_set():
            raise EndpointTimeout(f"{what}: abandoned at {deadline.what}") from exc
        raise EndpointError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _check_declared_length(headers: Mapping[str, str], max_bytes: int, what: str) -> None:
    declared = headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise EndpointError(f"{what}: the answer declares {int(declared)} bytes, more than the {max_bytes} read at "
                            "most (--max-response-bytes); nothing of it was read")


def _capped(chunks: Iterator[bytes], max_bytes: int, what: str, cancel: threading.Event) -> Iterator[bytes]:
    """The body's chunks until it passes max_bytes (EndpointError) or the caller gave up (EndpointTimeout)."""
    total = 0
    for chunk in chunks:
        if cancel.is_set():
            raise EndpointTimeout(f"{what}: abandoned at its deadline")
        total += len(chunk)
        if total > max_bytes:
            raise EndpointError(f"{what}: the answer passed {max_bytes} bytes (--max-response-bytes) and was not read "
                                "further")
        yield chunk


def _json_or_text(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")[:2000]


def _sse_events(chunks: Iterator[bytes], what: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of `data:` lines until `data: [DONE]`; EndpointError for an event that is not a JSON object
    or a stream that ends without [DONE]."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rstrip("\r")
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == DONE:
                return
            try:
                event = json.loads(data)
            except ValueError as exc:
                raise EndpointError(f"{what}: stream event is not JSON: {data[:200]!r}") from exc
            if not isinstance(event, dict):
                raise EndpointError(f"{what}: stream event is not a JSON object: {data[:200]!r}")
            yield event
    raise EndpointError(f"{what}: stream ended without `data: {DONE}`")
