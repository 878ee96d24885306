"""One request's run on the engine: submit it, then collect one JSON body or stream server-sent events.

Engine events arrive on the engine thread and are handed to the event loop; waiting re-checks the engine's
health so no client hangs on a dead engine, and the engine request is aborted however the response ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from k3verify.api.errors import APIError, engine_unavailable
from k3verify.api.render import SSE_DONE, Renderer, sse_event
from k3verify.api.state import ServedEngine, ServerState
from k3verify.serving.engine import ContextLengthError, EngineDeadError, EngineEvent
from k3verify.serving.sampler import SamplingParams, VocabError

POLL_S = 0.25


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


class Mailbox:
    """Engine-thread events for every stream of one event loop, handed over with one wake-up per burst: an engine
    step emits one event per running request, and a call_soon_threadsafe each (a self-pipe write and a loop
    callback apiece) was 64 wake-ups per step at 64 streams. Order is kept per stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue[EngineEvent], EngineEvent]] = []

    def post(self, queue: asyncio.Queue[EngineEvent], event: EngineEvent) -> None:
        with self.lock:
            self.items.append((queue, event))
            if len(self.items) > 1:  # a drain is already scheduled and will take this one too
                return
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, event in items:
            queue.put_nowait(event)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's mailbox (made on the loop's thread, where EventStreams are made)."""
    box = _MAILBOXES.get(loop)
    if box is None:
        box = _MAILBOXES[loop] = Mailbox(loop)
    return box


class EventStream:
    """Engine-thread events handed to the event loop; waiting re-checks engine health so nobody hangs."""

    def __init__(self, engine: ServedEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop
        self.queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.next_check = loop.time() + POLL_S
        self.mailbox = mailbox(loop)

    def put(self, event: EngineEvent) -> None:
        self.mailbox.post(self.queue, event)

    async def next(self, request: Request | None) -> EngineEvent:
        """The next event; a synthesized error event if the engine died; ClientGone if the client left."""
        while True:
            if request is not None and self.loop.time() >= self.next_check:
                self.next_check = self.loop.time() + POLL_S
                if await request.is_disconnected():
                    raise ClientGone
            try:  # an event already queued (the client is behind the engine): no timeout task to build and cancel
                return self.queue.get_nowait()
            except asyncio.QueueEmpty:
                pass
            try:
                return await asyncio.wait_for(self.queue.get(), POLL_S)
            except TimeoutError:
                reason = self.engine.health()
                if reason is not None:
                    return EngineEvent(error=reason, code="engine_unavailable")


class AbortOnClose(StreamingResponse):
    """A streaming response that aborts its engine request however the response ends (disconnect included)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def submit(engine: ServedEngine, prompt_ids: list[int], params: SamplingParams, events: EventStream,
           prompt_param: str) -> int:
    """Hand the request to the engine; its refusals become 400 (naming `prompt_param`) or 503."""
    try:
        params.check_vocab(engine.vocab_size)
    except VocabError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    try:
        return engine.submit(prompt_ids, params, events.put)
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param=prompt_param) from None


def engine_error(engine: ServedEngine, event: EngineEvent) -> APIError:
    """A failed event as an error: 503 when the engine is down or restarted under the request, else 500 (the
    request alone failed: non-finite logits, a sampling or detokenization error) with the engine's code."""
    if event.code == "engine_unavailable" or engine.health() is not None:
        return engine_unavailable(str(event.error))
    return APIError(500, str(event.error), type="server_error", code=event.code)


def bearer_digest(request: Request) -> str | None:
    """The prefix cache's key of a request: a digest of its bearer token (None without one). The engine keeps
    entries apart by it only under `serve --prefix-cache-per-key`."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(token.strip().encode()).hexdigest()


async def generate(state: ServerState, request: Request, prompt_ids: list[int], params: SamplingParams,
                   renderer: Renderer, *, stream: bool, prompt_param: str) -> Response:
    """Run one request: an SSE stream when `stream`, else one JSON body (499 if the client left first)."""
    engine = state.engine
    events = EventStream(engine, asyncio.get_running_loop())
    params = dataclasses.replace(params, cache_key=bearer_digest(request))
    seq_id = submit(engine, prompt_ids, params, events, prompt_param)
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    if stream:
        return AbortOnClose(sse_stream(state, events, renderer), on_close=functools.partial(engine.abort, seq_id))
    try:
        return await collect_response(state, request, events, renderer)
    except ClientGone:
        return Response(status_code=499)
    finally:
        engine.abort(seq_id)


async def collect_response(state: ServerState, request: Request, events: EventStream,
                           renderer: Renderer) -> JSONResponse:
    """Every event of the request rendered into one response body."""
    while True:
        event = await events.next(request)
        if event.error is not None:
            raise engine_error(state.engine, event)
        renderer.add(event)
        state.metrics.generation_tokens.inc(len(event.token_ids))
        if event.finished:
            return JSONResponse(renderer.response())


async def sse_stream(state: ServerState, events: EventStream, renderer: Renderer) -> AsyncIterator[str]:
    """The request's events as SSE chunks; an engine failure becomes an error chunk; always ends with [DONE]."""
    for chunk in renderer.start():
        yield sse_event(chunk)
    while True:
        event = await events.next(None)
        if event.error is not None:
            yield sse_event(engine_error(state.engine, event).envelope())
            break
        state.metrics.generation_tokens.inc(len(event.token_ids))
        for sse in renderer.sse_chunks(event):
            yield sse
        if event.finished:
            break
    yield SSE_DONE
