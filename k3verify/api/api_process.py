"""The HTTP server's process: uvicorn and the app over a RemoteEngine (api/remote_engine.py). Two entry points.

`main(fd)` is started by engine_link.ApiProcess (tests, bench, `parity --endpoint self`): FD is this end of a
socket pair to the engine's process, whose first message is the ApiConfig; the socket is bound here (port 0: any
free port) and its port sent back as ("ready", port) before uvicorn serves. The process exits when uvicorn stops
(SIGTERM / SIGINT) or when the engine's process closes the link: an API server without its engine must not keep a
port open.

`supervised_main(fd, listen_fd)` is started by `serve`'s supervisor (api/supervisor.py): FD is its control
connection (a FrontEndConfig first; EOF or ("stop",) later means stop), LISTEN_FD the listening socket the
supervisor bound and keeps, so a restarted front end answers on the same port and connections that arrive while
it restarts wait in the backlog. It connects to the engine's process over a private Unix socket; the engine's
EngineHello carries the tokenizer as the bytes the engine's gate checked, so nothing here reads the checkpoint.
If the engine's process dies, the requests in flight get error events or 503s and the front end connects again.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

import uvicorn

from k3verify.api.app import create_app
from k3verify.api.engine_link import START_TIMEOUT_S, ApiConfig, EngineHello
from k3verify.api.hosts import LOOPBACK_HOSTS, allowed_hosts
from k3verify.api.metrics import ServerMetrics
from k3verify.api.remote_engine import RECONNECT_S, RemoteEngine

HELLO_TIMEOUT_S = 10.0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(fd: int) -> int:
    conn = Connection(fd)
    kind, config = conn.recv()
    if kind != "config" or not isinstance(config, ApiConfig):
        conn.send(("failed", f"expected the API config first; got {kind!r}"))
        return 2
    try:
        tokenizer = config.tokenizer()
        sock = bind(config.host, config.port)
        hosts = allowed_hosts(config.host, config.allowed_hosts)
    except Exception as exc:  # reported to the engine's process, which raises it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    server: uvicorn.Server | None = None

    def lost() -> None:
        if server is not None:
            server.should_exit = True

    engine = RemoteEngine(conn, config.limits, config.state, tokenizer, on_lost=lost)
    metrics = ServerMetrics(engine_text=engine.metrics_text)
    app = create_app(engine, tokenizer, model_name=config.model_name, api_key=config.api_key, metrics=metrics,
                     default_max_tokens=config.default_max_tokens, encode_chat=config.encode_chat,
                     allowed_hosts=hosts)
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, lifespan="off"))
    engine.link.send(("ready", sock.getsockname()[1]))
    engine.start()
    server.run(sockets=[sock])
    return 0


@dataclass(frozen=True)
class FrontEndConfig:
    """What the supervisor tells a front end it starts (picklable)."""

    engine_address: str  # the engine process's Unix socket, in a directory only this user can enter
    authkey: bytes  # the link's handshake key, per `serve` run
    model_name: str
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS  # normalised Host names (api/hosts.py)
    default_max_tokens: int = 1024
    log_level: str = "info"


def connect_engine(address: str, authkey: bytes) -> tuple[Connection, EngineHello]:
    """A link to the engine's process and its hello; OSError / ValueError when it is not (yet) there."""
    try:
        conn = Client(address, family="AF_UNIX", authkey=authkey)
    except AuthenticationError as exc:
        raise ValueError(f"the engine's socket refused the handshake: {exc}") from None
    try:
        if not conn.poll(HELLO_TIMEOUT_S):
            raise OSError(f"the engine's process did not greet within {HELLO_TIMEOUT_S:g} s")
        kind, hello = conn.recv()
        if kind != "hello" or not isinstance(hello, EngineHello):
            raise ValueError(f"expected the engine's hello first; got {kind!r}")
    except BaseException:
        conn.close()
        raise
    return conn, hello


def _lifeline(control: Connection, server: uvicorn.Server, engine: RemoteEngine) -> None:
    """Stop when the supervisor says so or is gone (its end of the control connection closed)."""
    try:
        control.recv()
    except (EOFError, OSError):
        pass
    server.should_exit = True
    engine.close()


def supervised_main(fd: int, listen_fd: int) -> int:
    control = Connection(fd)
    kind, config, _restarts = control.recv()
    if kind != "start" or not isinstance(config, FrontEndConfig):
        control.send(("failed", f"expected the front end's config first; got {kind!r}"))
        return 2
    listener = socket.socket(fileno=listen_fd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            conn, hello = connect_engine(config.engine_address, config.authkey)
            break
        except (OSError, EOFError, ValueError) as exc:
            if time.monotonic() > deadline:
                control.send(("failed", f"cannot reach the engine's process at {config.engine_address}: {exc}"))
                return 1
            time.sleep(RECONNECT_S)
    try:
        tokenizer = hello.tokenizer()
    except Exception as exc:
        control.send(("failed", f"the engine's tokenizer does not load here: {type(exc).__name__}: {exc}"))
        return 1
    server: uvicorn.Server | None = None
    refused = threading.Event()

    def lost() -> None:  # the restarted engine serves another checkpoint: this front end must not pair with it
        refused.set()
        if server is not None:
            server.should_exit = True

    engine = RemoteEngine(conn, hello.limits, hello.state, tokenizer, on_lost=lost, digest=hello.digest,
                          reconnect=functools.partial(connect_engine, config.engine_address, config.authkey))
    metrics = ServerMetrics(engine_text=engine.metrics_text)
    app = create_app(engine, tokenizer, model_name=config.model_name, api_key=config.api_key, metrics=metrics,
                     default_max_tokens=config.default_max_tokens, allowed_hosts=config.allowed_hosts)
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, lifespan="off"))
    threading.Thread(target=_lifeline, args=(control, server, engine), name="k3verify-lifeline", daemon=True).start()
    engine.start()
    control.send(("ready", os.getpid()))
    server.run(sockets=[listener])
    return 1 if refused.is_set() else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
