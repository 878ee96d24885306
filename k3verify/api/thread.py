"""uvicorn in a background thread, for tests and the load test."""

from __future__ import annotations

import importlib.util
import threading

import uvicorn
from fastapi import FastAPI

FAST_IMPL = "uvloop+httptools"


def server_impl() -> str:
    """The event loop and HTTP implementation uvicorn's "auto" picks here (uvloop / httptools when importable)."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return f"{loop}+{http}"


def describe_server_impl() -> str:
    """One line for the serve log: which implementation uvicorn will run, and what the slower one costs (uvicorn
    falls back to asyncio / h11 without a word when uvloop / httptools are not installed)."""
    impl = server_impl()
    if impl == FAST_IMPL:
        return f"HTTP server {impl}"
    return (f"HTTP server {impl}: uvloop and httptools are not both installed (`pip install 'k3verify[serve]'` "
            "brings them); the server's CPU per streamed token was ~25% higher without them, time the engine "
            "thread waits for under many streams")


class ServerThread:
    """uvicorn in a background thread (tests, load test): `with ServerThread(app) as s: s.url`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="k3verify-uvicorn", daemon=True)
        self.host = host

    def __enter__(self) -> ServerThread:
        self.thread.start()
        for _ in range(500):
            if self.server.started or not self.thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not self.server.started:
            raise RuntimeError(f"uvicorn did not start on {self.host}")
        return self

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
