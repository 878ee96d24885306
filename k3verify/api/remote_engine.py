"""The API side of the engine link (api/engine_link.py): RemoteEngine is what the app holds instead of the Engine
when the engine runs in another process (api/state.ServedEngine).

It checks a request with the engine's own limits before it is sent, so a refusal is the same synchronous 400 as
in one process, and answers health from the last state the engine sent, or with why the link is gone. When the
link ends, every request in flight gets an engine_unavailable error event (a stream's error event, or a 503), never
silence. Then, given a way to reconnect (`serve`'s supervised front end), it connects again until the engine's
process is back, checking that the restarted engine serves the same checkpoint; without one it calls `on_lost`
(its process then exits: an API server without its engine must not keep a port open).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from k3verify.api.engine_link import EngineHello, EngineState, Link, unpack_event
from k3verify.serving.events import EngineDeadError, EngineEvent, TokenText
from k3verify.serving.health import HealthStatus
from k3verify.serving.request_limits import RequestLimits
from k3verify.serving.sampler import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 120.0
RECONNECT_S = 0.2  # between attempts to reach a restarting engine's process
Reconnect = Callable[[], tuple[Connection, EngineHello]]


class RemoteEngine:
    """The ServedEngine of an app whose engine runs in another process."""

    def __init__(self, conn: Connection, limits: RequestLimits, state: EngineState, tokenizer: Any,
                 on_lost: Callable[[], None] | None = None, *, reconnect: Reconnect | None = None,
                 digest: str | None = None) -> None:
        self.link = Link(conn)
        self.limits, self.vocab_size = limits, limits.vocab_size
        self.token_text = TokenText(tokenizer)
        self.digest = digest
        self._state = state
        self._lost: str | None = None
        self._on_lost = on_lost
        self._reconnect = reconnect
        self._closing = threading.Event()
        self._sinks: dict[int, Callable[[EngineEvent], None]] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="k3verify-link-in", daemon=True)

    def start(self) -> RemoteEngine:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop reconnecting and end the link (the front end is shutting down)."""
        self._closing.set()
        self.link.shutdown()

    # ---- ServedEngine ----
    @property
    def num_waiting(self) -> int:
        return self._state.num_waiting

    @property
    def num_running(self) -> int:
        return self._state.num_running

    def health(self) -> str | None:
        return self._lost if self._lost is not None else self._state.health

    def status(self) -> HealthStatus:
        if self._lost is None:
            return self._state.status
        s = self._state.status
        return HealthStatus("unhealthy", (self._lost,), s.restarts, s.nonfinite_failures)

    def validate(self, prompt_ids: list[int], max_tokens: int) -> None:
        self.limits.check(prompt_ids, max_tokens)

    def max_new_tokens_for(self, prompt_len: int) -> int:
        return self.limits.longest_completion(prompt_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[EngineEvent], None]) -> int:
        """Checked here with the engine's limits (ValueError / ContextLengthError), then sent; the id is this
        side's. A sink is registered only while the link is up (under the lock the link's loss takes), so a loss
        either finds it and fails it, or the submission is refused here."""
        self.limits.check_submission(prompt_ids, params)
        with self._lock:
            reason = self.health()
            if reason is not None:
                raise EngineDeadError(f"engine is not running: {reason}")
            rid = next(self._ids)
            self._sinks[rid] = sink
            link = self.link
        if not link.send(("submit", rid, list(prompt_ids), params)):
            with self._lock:
                self._sinks.pop(rid, None)
            raise EngineDeadError(f"engine is not running: {self.health() or 'the engine link is closed'}")
        return rid

    def abort(self, seq_id: int) -> None:
        with self._lock:
            running = self._sinks.pop(seq_id, None) is not None
            link = self.link
        if running:
            link.send(("abort", seq_id))

    def prompt_logprobs(self, prompt_ids: list[int], num_top: int) -> list[TokenLogprob | None]:
        result: list[TokenLogprob | None] = self.call("prompt_logprobs", list(prompt_ids), num_top)
        return result

    def metrics_text(self) -> bytes:
        if self._lost is not None:
            return b""
        text: bytes = self.call("metrics")
        return text

    def call(self, name: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """A call on the engine side, waited for (from a worker thread: never from the event loop's)."""
        fut: Future[Any] = Future()
        call_id = next(self._ids)
        with self._lock:
            if self._lost is not None:
                raise EngineDeadError(f"engine is not running: {self._lost}")
            self._calls[call_id] = fut
            link = self.link
        if not link.send(("call", call_id, name, args)):
            with self._lock:
                self._calls.pop(call_id, None)
            raise EngineDeadError("engine is not running: the engine link is closed")
        return fut.result(timeout)

    # ---- the link ----
    def _run(self) -> None:
        while True:
            self._receive()
            if self._closing.is_set():
                return
            if self._reconnect is None:
                self._lose("the engine process closed the link (it exited or was stopped)")
                if self._on_lost is not None:
                    self._on_lost()
                return
            self._lose("the engine process is gone (it exited or was killed); waiting for it to be restarted")
            if not self._connect_again():
                return

    def _receive(self) -> None:
        for msg in self.link.messages():
            kind = msg[0]
            if kind == "events":
                self._deliver(msg[1])
            elif kind == "state":
                self._state = msg[1]
            elif kind == "reply":
                with self._lock:
                    fut = self._calls.pop(msg[1], None)
                if fut is not None:
                    fut.set_result(msg[3]) if msg[2] else fut.set_exception(msg[3])
            else:
                log.error("engine link: unknown message %r from the engine side", kind)

    def _connect_again(self) -> bool:
        """Reach the restarted engine (True), or give up: closing, or it serves another checkpoint (False)."""
        assert self._reconnect is not None
        while not self._closing.wait(RECONNECT_S):
            try:
                conn, hello = self._reconnect()
            except (OSError, EOFError, ValueError) as exc:  # not listening yet, or refused the handshake
                log.debug("engine link: reconnect failed: %s", exc)
                continue
            if self.digest is not None and hello.digest != self.digest:
                conn.close()
                self._lost = (f"the restarted engine serves checkpoint {hello.digest}, not {self.digest}, which this "
                              "front end's tokenizer came from: refusing to pair them")
                log.error("engine link: %s", self._lost)
                if self._on_lost is not None:
                    self._on_lost()
                return False
            with self._lock:
                self.link, self.limits, self._state = Link(conn), hello.limits, hello.state
                self._lost = None
            log.warning("engine link: connected to the restarted engine")
            return True
        return False

    def _deliver(self, items: list[tuple[Any, ...]]) -> None:
        for item in items:
            rid, event = unpack_event(item)
            with self._lock:
                sink = self._sinks.pop(rid, None) if event.finished else self._sinks.get(rid)
            if sink is None:
                continue  # aborted here after the engine emitted
            try:
                sink(event)
            except Exception:
                log.exception("sink of request %d failed", rid)

    def _lose(self, reason: str) -> None:
        """Every request in flight gets an engine_unavailable error event; new ones are refused until reconnected."""
        with self._lock:
            self._lost = reason
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for sink in sinks.values():
            try:
                sink(EngineEvent(error=reason, code="engine_unavailable"))
            except Exception:
                log.exception("sink failed while the engine link closed")
        for fut in calls.values():
            fut.set_exception(EngineDeadError(f"engine is not running: {reason}"))
