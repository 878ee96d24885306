"""`python -m k3verify.server.api_process FD`: the HTTP server's process (started by engine_link.ApiProcess).

FD is this end of the socket pair to the engine's process. The first message is the ApiConfig; the app is the
one `create_app` builds, over a RemoteEngine; the socket is bound here (port 0: any free port) and its port
sent back as ("ready", port) before uvicorn serves. The process exits when uvicorn stops (SIGTERM / SIGINT)
or when the engine's process closes the link: an API server without its engine must not keep a port open.
"""

from __future__ import annotations

import socket
import sys
from multiprocessing.connection import Connection

import uvicorn

from k3verify.server.app import create_app
from k3verify.server.engine_link import ApiConfig, RemoteEngine
from k3verify.server.metrics import ServerMetrics


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
                     default_max_tokens=config.default_max_tokens, encode_chat=config.encode_chat)
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, lifespan="off"))
    engine.link.send(("ready", sock.getsockname()[1]))
    engine.start()
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
