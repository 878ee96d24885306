"""OpenAI-compatible HTTP layer (FastAPI) over the Engine: completions, chat, models, health, metrics.

Every error, including FastAPI's own validation/404/405 responses, leaves as the OpenAI envelope.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from k3verify.server.errors import APIError, error_response
from k3verify.server.metrics import ServerMetrics
from k3verify.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body, parse_request
from k3verify.server.render import (
    ChatRenderer,
    CompletionRenderer,
    ModelCard,
    ModelList,
    Renderer,
    make_id,
    sse_event,
    unix_time,
)
from k3verify.serving.engine import ContextLengthError, Engine, EngineDeadError, EngineEvent
from k3verify.serving.sampler import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16
POLL_S = 0.25
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _ClientGone(Exception):
    pass


class _EventStream:
    """Engine-thread events handed to the event loop; waiting re-checks engine health so nobody hangs."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop
        self.queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.next_check = loop.time() + POLL_S

    def put(self, event: EngineEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self, request: Request | None) -> EngineEvent:
        """The next event; a synthesized error event if the engine died; _ClientGone if the client left."""
        while True:
            if request is not None and self.loop.time() >= self.next_check:
                self.next_check = self.loop.time() + POLL_S
                if await request.is_disconnected():
                    raise _ClientGone
            try:
                return await asyncio.wait_for(self.queue.get(), POLL_S)
            except TimeoutError:
                reason = self.engine.health()
                if reason is not None:
                    return EngineEvent(error=reason)


class _AbortOnClose(StreamingResponse):
    """A streaming response that aborts its engine request however the response ends (disconnect included)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _CountRequests:
    """ASGI middleware counting responses by route and status code."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ROUTES else "other"

        started = False

        async def counting_send(message: Any) -> None:
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


def create_app(engine: Engine, tokenizer: Any, *, model_name: str, api_key: str | None = None,
               metrics: ServerMetrics | None = None, default_max_tokens: int = 1024,
               encode_chat: Callable[[list[dict[str, Any]]], list[int]] | None = None) -> FastAPI:
    """The FastAPI app; `encode_chat` defaults to the tokenizer's own chat template (k3verify.tokenizer).
    A chat request without max_tokens gets what still fits, capped at default_max_tokens: the runner reserves
    cache for prompt + max_tokens at admission, so an uncapped default would serialize all such requests."""
    metrics = metrics or ServerMetrics()
    if encode_chat is None:
        from k3verify.tokenizer import encode_chat as kimi_encode_chat

        def encode_chat(messages: list[dict[str, Any]]) -> list[int]:
            return kimi_encode_chat(tokenizer, messages)

    chat_encoder = encode_chat
    app = FastAPI(title="k3verify", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def _server_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {str(exc)[:200]}",
                                       type="server_error"))

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                           type="invalid_request_error", code="invalid_api_key")

    async def read_body(request: Request) -> Any:
        return parse_body(await request.body())

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None
                 ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
            stop=tuple(req.stop_list), stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=logprobs,
            ignore_eos=req.ignore_eos)

    async def generate(request: Request, prompt_ids: list[int], params: SamplingParams, renderer: Renderer,
                       *, stream: bool, prompt_param: str) -> Response:
        events = _EventStream(engine, asyncio.get_running_loop())
        try:
            seq_id = engine.submit(prompt_ids, params, events.put)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=prompt_param) from None
        metrics.prompt_tokens.inc(len(prompt_ids))
        if stream:
            return _AbortOnClose(sse(events, renderer), on_close=lambda: engine.abort(seq_id))
        try:
            while True:
                event = await events.next(request)
                if event.error is not None:
                    raise engine_error(event)
                renderer.add(event)
                metrics.generation_tokens.inc(len(event.token_ids))
                if event.finished:
                    return JSONResponse(renderer.response())
        except _ClientGone:
            return Response(status_code=499)
        finally:
            engine.abort(seq_id)

    def engine_error(event: EngineEvent) -> APIError:
        if engine.health() is not None:
            return APIError(503, str(event.error), type="server_error", code="engine_unavailable")
        return APIError(500, str(event.error), type="server_error")

    async def sse(events: _EventStream, renderer: Renderer) -> AsyncIterator[str]:
        for chunk in renderer.start():
            yield sse_event(chunk)
        while True:
            event = await events.next(None)
            if event.error is not None:
                yield sse_event(engine_error(event).envelope())
                break
            metrics.generation_tokens.inc(len(event.token_ids))
            for chunk in renderer.chunks(event):
                yield sse_event(chunk)
            if event.finished:
                break
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await read_body(request))
        check_model(req.model)
        prompt = req.single_prompt
        ids = await asyncio.to_thread(tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
        renderer = CompletionRenderer(make_id("cmpl"), unix_time(), model_name, engine.token_text,
                                      want_logprobs=req.logprobs is not None, include_usage=req.include_usage)
        params = sampling(req, DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens, req.logprobs)
        return await generate(request, ids, params, renderer, stream=req.stream, prompt_param="prompt")

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await read_body(request))
        check_model(req.model)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids = await asyncio.to_thread(chat_encoder, messages)
        except ValueError as exc:
            raise APIError(400, f"messages could not be rendered: {exc}", param="messages") from None
        max_tokens = req.max_new_tokens or max(1, min(default_max_tokens, engine.max_new_tokens_for(len(ids))))
        renderer = ChatRenderer(make_id("chatcmpl"), unix_time(), model_name, engine.token_text,
                                want_logprobs=req.logprobs, include_usage=req.include_usage)
        params = sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        return await generate(request, ids, params, renderer, stream=req.stream, prompt_param="messages")

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models() -> JSONResponse:
        card = ModelCard(id=model_name, created=unix_time(), max_model_len=engine.runner.max_context)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = engine.health()
        if reason is not None:
            return error_response(APIError(503, reason, type="server_error", code="engine_unavailable"))
        return JSONResponse({"status": "ok", "waiting": engine.num_waiting, "running": engine.num_running})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    app.add_middleware(_CountRequests, metrics=metrics)
    return app


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
