"""ASGI middleware counting every response by route and status code into the server's metrics."""

from __future__ import annotations

from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from k3verify.api.metrics import ServerMetrics


class CountRequests:
    """Counts responses by route (paths outside `routes` count as "other") and status code; an exception
    that escapes before any response started counts as the 500 the outermost error handler answers."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: Collection[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.routes else "other"

        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # the outermost error middleware will answer 500
                self.metrics.count_request(endpoint, 500)
            raise
