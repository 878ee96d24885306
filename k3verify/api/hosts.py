"""Which `Host` headers the server answers: loopback names, the bind address, and what the operator allows.

Why: a page in a browser can make the browser talk to a server on loopback through DNS rebinding (a name the page
controls, re-pointed at 127.0.0.1): the requests then carry that name as their Host. Answering only known names
closes that door (421 Misdirected Request in the OpenAI envelope). A server bound to 0.0.0.0 is reached under
names the process cannot know: the operator lists them with `serve --allowed-host NAME`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from k3verify.api.errors import APIError, error_response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = ("0.0.0.0", "::", "[::]")


class HostNameError(ValueError):
    """A name given as an allowed host that no Host header could carry."""


def host_name(value: str) -> str:
    """The name part of a Host header (or of a bind address) as compared: lower case, port and one trailing dot
    dropped, an IPv6 literal in brackets."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        return v[: end + 1] if end > 0 else v
    if v.count(":") > 1:  # a bare IPv6 literal (a bind address); no Host header carries one without brackets
        try:
            return f"[{ipaddress.IPv6Address(v)}]"
        except ValueError:
            return v
    name = v.partition(":")[0]
    return name[:-1] if name.endswith(".") and len(name) > 1 else name


def check_allowed_name(name: str) -> str:
    """`name` (a host name or IP, optionally with a port) normalised; HostNameError naming it if no Host header could
    carry it (a URL, a path, whitespace, an empty name)."""
    bad = not name.strip() or any(c.isspace() or c in "/?#@\\" for c in name.strip()) or "://" in name
    normal = host_name(name)
    if bad or not normal or normal.startswith(":"):
        raise HostNameError(f"{name!r} is not a host name or address (give what clients put in the Host header, "
                            "e.g. api.example.com or 10.0.0.5, without a scheme or path)")
    return normal


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """Loopback names, the bind address (unless it is a wildcard: no client names 0.0.0.0) and `extra`, normalised."""
    names = list(LOOPBACK_HOSTS)
    if bind_host.strip().lower() not in WILDCARD_BINDS:
        names.append(check_allowed_name(bind_host))
    names += [check_allowed_name(n) for n in extra]
    return tuple(dict.fromkeys(names))


def only_loopback(hosts: Collection[str]) -> bool:
    return set(hosts) <= set(LOOPBACK_HOSTS)


def misdirected(host: str | None, allowed: Collection[str]) -> APIError:
    got = "no Host header" if host is None else f"Host {host[:100]!r}"
    return APIError(421, f"this server does not answer for {got}; it answers for {', '.join(sorted(allowed))} (the "
                         "operator adds names with `k3verify serve --allowed-host NAME`)", code="misdirected_request")


class CheckHost:
    """ASGI middleware: 421 in the envelope for any HTTP request whose Host is not allowed (every route)."""

    def __init__(self, app: ASGIApp, allowed: Collection[str]) -> None:
        self.app, self.allowed = app, frozenset(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k == b"host"), None)
        host = None if raw is None else raw.decode("latin-1")
        if host is None or host_name(host) not in self.allowed:
            await error_response(misdirected(host, self.allowed))(scope, receive, send)
            return
        await self.app(scope, receive, send)
