"""A browser's reach: the server answers only Host names it knows (loopback, the bind address, --allowed-host),
421 in the envelope otherwise, and `serve` says how to keep a 0.0.0.0 deployment working."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from server_harness import TINY, RunningServer, running_server
from test_server_errors import GOOD, assert_envelope

from k3verify.api.hosts import HostNameError, allowed_hosts, check_allowed_name, host_name
from k3verify.cli import build_parser
from k3verify.commands import serve
from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:8000", "127.0.0.1.evil.example.com",
                                  "localhost.evil.example.com", "[::2]:80", "0.0.0.0", ""])
def test_a_foreign_host_is_421_on_every_route(tiny_server: RunningServer, host: str) -> None:
    """DNS rebinding: a request carrying another name as its Host gets 421 in the envelope, /health included."""
    for method, path in (("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models")):
        r = httpx.request(method, f"{tiny_server.url}{path}", json=GOOD if method == "POST" else None,
                          headers={"Host": host}, timeout=10)
        err = assert_envelope(r, 421, contains="this server does not answer for Host")
        assert err["code"] == "misdirected_request" and "--allowed-host NAME" in err["message"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:8000",
                                  "localhost."])
def test_loopback_names_with_or_without_a_port_are_answered(tiny_server: RunningServer, host: str) -> None:
    """localhost, 127.0.0.1 and [::1], any port, any case."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD, headers={"Host": host}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_openai_client_on_loopback_is_answered(client: openai.OpenAI) -> None:
    """What `parity --endpoint self` and the tests drive: the official client on 127.0.0.1."""
    assert client.completions.create(model=TINY, prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize("api_process", [False, True], ids=["in_process", "api_process"])
def test_allowed_host_adds_names(api_process: bool) -> None:
    """--allowed-host NAME (and NAME:port) is answered; a name not listed still gets 421."""
    with running_server(api_process=api_process, allowed_hosts=("api.example.com", "10.0.0.5:8000")) as server:
        for host in ("api.example.com", "API.example.com:443", "10.0.0.5", "localhost"):
            r = httpx.post(f"{server.url}/v1/completions", json=GOOD, headers={"Host": host}, timeout=60)
            assert r.status_code == 200, (host, r.text)
        r = httpx.get(f"{server.url}/health", headers={"Host": "other.example.com"}, timeout=10)
        assert_envelope(r, 421, contains="api.example.com")


def test_host_names_are_normalised_and_bad_ones_refused() -> None:
    """Ports, case, a trailing dot and bare IPv6 literals normalise; URLs and paths are not host names."""
    assert host_name("Example.COM:8080") == "example.com" and host_name("[::1]:80") == "[::1]"
    assert host_name("::1") == "[::1]" and host_name("a.example.") == "a.example"
    assert allowed_hosts("0.0.0.0") == ("localhost", "127.0.0.1", "[::1]")
    assert allowed_hosts("10.1.2.3", ["api.example.com:443"]) == ("localhost", "127.0.0.1", "[::1]", "10.1.2.3",
                                                                   "api.example.com")
    for bad in ("http://api.example.com", "api.example.com/v1", "", " ", "a b", "user@host"):
        with pytest.raises(HostNameError, match="is not a host name or address"):
            check_allowed_name(bad)


def test_serve_refuses_a_bad_allowed_host_and_warns_on_a_wildcard_bind(caplog: pytest.LogCaptureFixture) -> None:
    """`serve --allowed-host http://x` is a usage error; --host 0.0.0.0 with only loopback names allowed logs a
    warning naming --allowed-host, and none once a name is given."""
    with pytest.raises(UsageError, match="--allowed-host / --host: 'http://x' is not a host name"):
        serve.require_gate(ServeOptions.from_args(build_parser().parse_args(["serve", "--allowed-host", "http://x"])))
    args = ServeOptions.from_args(build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    with caplog.at_level(logging.WARNING, logger="k3verify.commands.serve"):
        serve.warn_about_wildcard_bind(args, serve.hosts_for(args))
    assert "--host 0.0.0.0" in caplog.text and "--allowed-host NAME" in caplog.text
    caplog.clear()
    args = ServeOptions.from_args(build_parser().parse_args(["serve", "--host", "0.0.0.0", "--allowed-host",
                                                                "api.example.com"]))
    with caplog.at_level(logging.WARNING, logger="k3verify.commands.serve"):
        serve.warn_about_wildcard_bind(args, serve.hosts_for(args))
    assert caplog.text == ""
