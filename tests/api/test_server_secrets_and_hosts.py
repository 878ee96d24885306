"""Keys stay secret and Host is parsed strictly: the API key from a file or K3V_API_KEY (exactly one source, never
echoed), no K3V_ secret in a report's environment, no query string in the access log, and a Host header with
userinfo, a path or a second copy answered 421."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from k3verify.api.access_log import ACCESS_LOGGER, DropQueryString, redact_access_log
from k3verify.api.hosts import CheckHost, allowed_hosts
from k3verify.cli import build_parser
from k3verify.commands.serve_keys import API_KEY_ENV, resolve_api_key
from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError
from k3verify.gates.core.suite import recorded_environment

SECRET = "sk-test-0123456789"


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status_for(headers: list[tuple[bytes, bytes]]) -> int:
    """The status CheckHost (loopback names allowed) answers a GET / with these raw headers."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "raw_path": b"/", "query_string": b"", "headers": headers,
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1),
             "root_path": ""}
    asyncio.run(CheckHost(_ok, allowed_hosts("127.0.0.1"))(scope, receive, send))
    return int(sent[0]["status"])


@pytest.mark.parametrize("headers", [
    [(b"host", b"localhost:8000@evil.example")], [(b"host", b"user@localhost")],
    [(b"host", b"localhost"), (b"host", b"evil.example")], [(b"host", b"localhost"), (b"host", b"localhost")],
    [(b"host", b"localhost/x")], [(b"host", b"local host")], [(b"host", b"localhost:80:81")], [],
], ids=["userinfo after port", "userinfo", "two names", "the same name twice", "path", "space", "two ports", "none"])
def test_a_host_header_that_is_not_exactly_one_host_is_421(headers: list[tuple[bytes, bytes]]) -> None:
    assert status_for(headers) == 421


@pytest.mark.parametrize("host", [b"localhost", b"localhost:8000", b"127.0.0.1:1", b"[::1]:8000", b"LOCALHOST."])
def test_one_loopback_host_with_or_without_a_port_is_answered(host: bytes) -> None:
    """The control: the same middleware answers one well-formed loopback Host."""
    assert status_for([(b"host", host)]) == 200


def test_the_api_key_comes_from_exactly_one_source(tmp_path: Path) -> None:
    """--api-key-file (its trailing newline not part of the key) or K3V_API_KEY; two sources, or a file that cannot
    be read, are usage errors that never show the key."""
    key_file = tmp_path / "api.key"
    key_file.write_text(SECRET + "\n")
    assert resolve_api_key(None, key_file, {}) == SECRET
    assert resolve_api_key(None, None, {API_KEY_ENV: SECRET}) == SECRET
    assert resolve_api_key(None, None, {}) is None
    for flag, path, env in ((SECRET, key_file, {}), (None, key_file, {API_KEY_ENV: SECRET}),
                            (SECRET, None, {API_KEY_ENV: SECRET})):
        with pytest.raises(UsageError, match="give it one way only") as err:
            resolve_api_key(flag, path, env)
        assert SECRET not in str(err.value)
    with pytest.raises(UsageError, match="cannot be read"):
        resolve_api_key(None, tmp_path / "absent.key", {})


def test_serve_reads_the_key_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "api.key"
    key_file.write_text(SECRET)
    parse = build_parser().parse_args
    assert ServeOptions.from_args(parse(["serve", "--api-key-file", str(key_file)])).api_key == SECRET
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    assert ServeOptions.from_args(parse(["serve"])).api_key == SECRET


def test_a_secret_k3v_variable_is_never_recorded_in_a_report() -> None:
    """K3V_API_KEY (any K3V_ name with KEY, TOKEN, SECRET or PASSWORD) is listed as set, its value not recorded;
    other K3V_ variables are recorded as they are."""
    env = recorded_environment({API_KEY_ENV: SECRET, "K3V_CACHE_DIR": "/c", "K3V_HF_TOKEN": SECRET, "HOME": "/h"})
    assert env["K3V_CACHE_DIR"] == "/c" and "HOME" not in env
    assert SECRET not in repr(env) and set(env) == {API_KEY_ENV, "K3V_CACHE_DIR", "K3V_HF_TOKEN"}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_access_log_drops_query_strings() -> None:
    """A client that sends its key as ?api_key=...: uvicorn's access line keeps the path and status, not the query;
    a path without a query is logged as it is."""
    redact_access_log()
    redact_access_log()  # once per process however often the app is built
    logger = logging.getLogger(ACCESS_LOGGER)
    assert sum(isinstance(f, DropQueryString) for f in logger.filters) == 1
    sink, level, disabled = _Lines(), logger.level, logger.disabled
    logger.addHandler(sink)
    logger.setLevel(logging.INFO)
    logger.disabled = False  # another test's uvicorn may have configured this logger
    try:
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", f"/v1/models?api_key={SECRET}", "1.1", 401)
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/health", "1.1", 200)
    finally:
        logger.removeHandler(sink)
        logger.setLevel(level)
        logger.disabled = disabled
    assert sink.lines == ['127.0.0.1:1 - "GET /v1/models?(query not logged) HTTP/1.1" 401',
                          '127.0.0.1:1 - "GET /health HTTP/1.1" 200']
