"""The HTTP server in a process of its own, linked to the engine's process by one socket.

Why: in one process the engine thread and the HTTP server share one GIL, so the time uvicorn spends parsing,
rendering and writing the streams' tokens is added to the engine's steps; with many streams that is as long as a
step itself.
With the link, the engine's process runs the step loop, detokenization and stop strings; the API process runs
uvicorn, request parsing, prompt tokenization and SSE rendering.

Engine side: EngineHost serves the link (submit, abort, prompt logprobs, the engine's metrics) and sends the
engine's events back batched (one message per burst: an engine step emits one event per running request) with
the engine's load and health whenever they change; when the link ends, the requests it submitted are aborted
(their client is gone with it). API side: RemoteEngine (api/remote_engine.py) is what the app holds instead of
the Engine. Two ways to run them: ApiProcess starts k3verify.api.api_process's main (from this process's own
package) over a socket pair and waits until it listens (tests, bench, `parity --endpoint self`); under `serve`'s
supervisor (api/supervisor.py) the engine's process listens on a private Unix socket and the HTTP process
connects to it, greeted by an EngineHello, and connects again after either side was restarted.

Wire: engine -> API ("hello", EngineHello) (supervised links, first), ("events", [(rid, text, token_ids,
logprobs, finish_reason, error, code, prompt_tokens, completion_tokens), ...]), ("state", EngineState),
("reply", call_id, ok, value), ("ready", port) / ("failed", why); API -> engine ("submit", rid, prompt_ids,
params), ("abort", rid), ("call", call_id, name, args).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from k3verify.serving.engine import Engine
from k3verify.serving.events import EngineDeadError, EngineEvent
from k3verify.serving.health import HealthStatus
from k3verify.serving.request_limits import RequestLimits
from k3verify.serving.sampler import SamplingParams

log = logging.getLogger(__name__)

# The API process imports the very package this process runs (the folder holding k3verify/ first on its path):
# `python -m` would put the working directory first, and a k3verify folder there (another checkout, a mutant's
# copy) would serve requests with other code than the engine's.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
API_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); from k3verify.api.api_process import main; "
            "sys.exit(main(int(sys.argv[2])))")
STATE_POLL_S = 0.05  # how often the engine side looks for a change of load or health
CALL_TIMEOUT_S = 120.0
START_TIMEOUT_S = 120.0  # the API process's imports, tokenizer and bind


class ApiStartError(RuntimeError):
    """The API process could not start (its reason: a port in use, a tokenizer that does not load, ...)."""


@dataclass(frozen=True)
class EngineState:
    """What the engine side last reported: health() (None while serving), status(), load."""

    health: str | None
    status: HealthStatus
    num_waiting: int
    num_running: int


@dataclass(frozen=True)
class EngineHello:
    """What the engine's process tells a front end that connects: its limits and state, the tokenizer (a picklable
    callable over the very bytes the engine's gate checked) and the checkpoint digest those bytes have."""

    limits: RequestLimits
    state: EngineState
    tokenizer: Callable[[], Any]
    digest: str


@dataclass(frozen=True)
class ApiConfig:
    """Everything the API process needs to build the app; picklable (factories are module-level callables or
    functools.partial of them)."""

    limits: RequestLimits
    state: EngineState
    tokenizer: Callable[[], Any]
    model_name: str
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    default_max_tokens: int = 1024
    encode_chat: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]] | None = None
    log_level: str = "warning"
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback and `host` (api/hosts.py)


def pack_event(rid: int, ev: EngineEvent) -> tuple[Any, ...]:
    return (rid, ev.text, ev.token_ids, ev.logprobs, ev.finish_reason, ev.error, ev.code, ev.prompt_tokens,
            ev.completion_tokens, ev.cached_tokens)


def unpack_event(item: tuple[Any, ...]) -> tuple[int, EngineEvent]:
    rid, text, ids, lps, finish, error, code, prompt_tokens, completion_tokens, cached_tokens = item
    return rid, EngineEvent(text=text, token_ids=ids, logprobs=lps, finish_reason=finish, error=error, code=code,
                            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            cached_tokens=cached_tokens)


def engine_state(engine: Engine) -> EngineState:
    return EngineState(engine.health(), engine.status(), engine.num_waiting, engine.num_running)


class Link:
    """One end of the socket: sends from any thread (one lock), receives on one thread."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()

    def shutdown(self) -> None:
        """End the link for both sides now: a blocked recv here returns and the peer reads EOF (closing the fd alone
        does neither while another thread is reading it)."""
        try:
            sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        except OSError:
            return  # already closed
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()

    def messages(self) -> Iterator[tuple[Any, ...]]:
        """What the other side sends, until it closes the link (or this side shuts it down)."""
        while True:
            try:
                yield self.conn.recv()
            except (EOFError, OSError):
                return

    def send(self, msg: tuple[Any, ...]) -> bool:
        """False when the other side is gone."""
        try:
            with self.send_lock:
                self.conn.send(msg)
            return True
        except (OSError, EOFError, ValueError):
            return False


class EngineHost:
    """The engine side of the link: requests and calls in, events and state out (two daemon threads)."""

    def __init__(self, engine: Engine, conn: Connection, metrics_text: Callable[[], bytes],
                 hello: EngineHello | None = None) -> None:
        self.engine, self.link, self.metrics_text, self.hello = engine, Link(conn), metrics_text, hello
        self._cond = threading.Condition()
        self._out: list[tuple[Any, ...]] = []
        self._closed = threading.Event()
        self._seq: dict[int, int] = {}  # rid -> the engine's seq_id while running
        self._ended_early: set[int] = set()  # finished before submit() returned its seq_id
        self._map_lock = threading.Lock()
        self._last_state: EngineState | None = None
        self._threads = [threading.Thread(target=self._receive, name="k3verify-link-in", daemon=True),
                         threading.Thread(target=self._send_events, name="k3verify-link-out", daemon=True)]

    def start(self) -> EngineHost:
        if self.hello is not None:
            self._last_state = engine_state(self.engine)
            self.link.send(("hello", dataclasses.replace(self.hello, state=self._last_state)))
        for t in self._threads:
            t.start()
        return self

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            self._cond.notify()
        self.link.shutdown()

    def post(self, rid: int, event: EngineEvent) -> None:
        """The sink of request rid (called on the engine thread): queued for the next send."""
        if event.finished:
            with self._map_lock:
                if self._seq.pop(rid, None) is None:
                    self._ended_early.add(rid)
        with self._cond:
            self._out.append(pack_event(rid, event))
            if len(self._out) == 1:
                self._cond.notify()

    def _send_events(self) -> None:
        looked = 0.0
        while not self.closed:
            with self._cond:
                if not self._out:
                    self._cond.wait(STATE_POLL_S)
                items, self._out = self._out, []
            if items and not self.link.send(("events", items)):
                break
            now = time.monotonic()
            # Under load a batch goes every step: the state follows a batch only when a request in it ended (a
            # failure there may have changed the engine's health, which a client asks next), else every
            # STATE_POLL_S.
            ended = any(item[4] is not None or item[5] is not None for item in items)  # finish_reason, error
            if not ended and now - looked < STATE_POLL_S:
                continue
            looked, state = now, engine_state(self.engine)
            if state != self._last_state:
                self._last_state = state
                if not self.link.send(("state", state)):
                    break
        self._closed.set()

    def _receive(self) -> None:
        for msg in self.link.messages():
            try:
                self._handle(msg)
            except Exception:  # one bad message must not stop the link
                log.exception("engine link: failed to handle %r", msg[0] if msg else msg)
        self.close()
        with self._map_lock:  # the front end is gone, and its clients with it: free their slots
            orphans, self._seq = list(self._seq.values()), {}
        for seq_id in orphans:
            self.engine.abort(seq_id)
        with self.link.send_lock:
            self.link.conn.close()

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "submit":
            self._submit(msg[1], msg[2], msg[3])
        elif kind == "abort":
            with self._map_lock:
                seq_id = self._seq.pop(msg[1], None)
            if seq_id is not None:
                self.engine.abort(seq_id)
        elif kind == "call":
            threading.Thread(target=self._call, args=msg[1:], name="k3verify-link-call", daemon=True).start()
        else:
            raise ValueError(f"unknown engine link message {kind!r}")

    def _submit(self, rid: int, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            seq_id = self.engine.submit(prompt_ids, params, functools.partial(self.post, rid))
        except Exception as exc:  # checked on the API side first: here only when the engine died meanwhile
            code = "engine_unavailable" if isinstance(exc, EngineDeadError) else "request_refused"
            self.post(rid, EngineEvent(error=str(exc), code=code, prompt_tokens=len(prompt_ids)))
            with self._map_lock:
                self._ended_early.discard(rid)  # post() took it for a request that ended before its seq_id
            return
        with self._map_lock:
            if rid in self._ended_early:
                self._ended_early.discard(rid)
            else:
                self._seq[rid] = seq_id

    def _call(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            if name == "prompt_logprobs":
                value: Any = self.engine.prompt_logprobs(*args)
            elif name == "metrics":
                value = self.metrics_text()
            else:
                raise ValueError(f"unknown engine call {name!r}")
            self.link.send(("reply", call_id, True, value))
        except Exception as exc:
            self.link.send(("reply", call_id, False, exc))


class ApiProcess:
    """`with ApiProcess(engine, config, metrics_text) as api: api.url`: the app served by uvicorn in a child
    process (python -m k3verify.api.api_process), linked to `engine` (already started) in this one."""

    def __init__(self, engine: Engine, config: ApiConfig, metrics_text: Callable[[], bytes]) -> None:
        self.engine, self.config, self.metrics_text = engine, config, metrics_text
        self.proc: subprocess.Popen[bytes] | None = None
        self.host_link: EngineHost | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def __enter__(self) -> ApiProcess:
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", API_MAIN, PACKAGE_ROOT, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        conn = Connection(os.dup(ours.fileno()))
        ours.close()
        try:
            conn.send(("config", self.config))
            self.port = self._wait_ready(conn)
        except BaseException:
            conn.close()
            self._stop_process()
            raise
        self.host_link = EngineHost(self.engine, conn, self.metrics_text).start()
        return self

    def _wait_ready(self, conn: Connection) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc is not None
        while time.monotonic() < deadline:
            if conn.poll(0.1):
                try:
                    msg = conn.recv()
                except EOFError:
                    break
                if msg[0] == "ready":
                    return int(msg[1])
                raise ApiStartError(f"the API server process could not start: {msg[1]}")
            if self.proc.poll() is not None:
                break
        rc = self.proc.poll()
        raise ApiStartError("the API server process " + (f"exited with code {rc} before it listened" if rc is not None
                            else f"did not listen within {START_TIMEOUT_S:g} s"))

    def wait(self) -> int:
        """Block until the API process exits (serve's foreground); its exit code."""
        assert self.proc is not None
        return self.proc.wait()

    def _stop_process(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # uvicorn shuts down gracefully on SIGTERM
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self._stop_process()
        if self.host_link is not None:
            self.host_link.close()


def api_config(engine: Engine, tokenizer: Callable[[], Any], model_name: str, **kw: Any) -> ApiConfig:
    """The ApiConfig of `engine` (its limits and current state) with the app's settings."""
    return ApiConfig(limits=engine.limits, state=engine_state(engine), tokenizer=tokenizer, model_name=model_name,
                     **kw)


__all__ = ["ApiConfig", "ApiProcess", "ApiStartError", "EngineHello", "EngineHost", "EngineState", "api_config"]
