"""Which `Host` headers the server answers: loopback names, the bind address, and what the operator allows.

Why: a page in a browser can make the browser talk to a server on loopback through DNS rebinding (a name the page
controls, re-pointed at 127.0.0.1): the requests then carry that name as their Host. Answering only known names
closes that door (421 Misdirected Request in the OpenAI envelope). A server bound to 0.0.0.0 is reached under
names the process cannot know: the operator lists them with `serve --allowed-host NAME`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from k3verify.api.errors import APIError, error_response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = ("0.0.0.0", "::", "[::]")
# RFC 9110 Host: uri-host [ ":" port ]; a reg-name or IPv4 of letters, digits, '-', '.', or an IPv6 literal in
# brackets. Userinfo ('@'), a path or a second value is not a Host a client sends: such a header is refused whole.
_STRICT_HOST = re.compile(r"(?:[a-z0-9](?:[a-z0-9.-]*[a-z0-9.])?|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?")


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
    got = "no Host header" if host is None else f"Host {host[:100]!r} (one Host header, a name and a port only)"
    return APIError(421, f"this server does not answer for {got}; it answers for {', '.join(sorted(allowed))} (the "
                         "operator adds names with `k3verify serve --allowed-host NAME`)", code="misdirected_request")


def strict_host(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """(the request's Host header, its name as compared) when there is exactly one and it is a host with an optional
    port; (what was sent, None) for none, two or more, or anything else (userinfo, a path, spaces)."""
    values = [v.decode("latin-1") for k, v in headers if k == b"host"]
    if len(values) != 1:
        return (None if not values else " + ".join(values)), None
    value = values[0]
    if not _STRICT_HOST.fullmatch(value.lower()):
        return value, None
    return value, host_name(value)


class CheckHost:
    """ASGI middleware: 421 in the envelope for any HTTP request whose Host is not allowed (every route)."""

    def __init__(self, app: ASGIApp, allowed: Collection[str]) -> None:
        self.app, self.allowed = app, frozenset(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host, name = strict_host(scope["headers"])
        if name is None or name not in self.allowed:
            await error_response(misdirected(host, self.allowed))(scope, receive, send)
            return
        await self.app(scope, receive, send)
