"""OpenAI-compatible HTTP layer (FastAPI) over the Engine: completions, chat, models, health, metrics.

Every error, including FastAPI's own validation/404/405 responses, leaves as the OpenAI envelope
(k3verify.api.errors). The handlers are plain functions; what they share is `app.state.server`.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Collection
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from k3verify.api.access_log import redact_access_log
from k3verify.api.body import read_json
from k3verify.api.chat_render import ChatRenderer
from k3verify.api.echo import echo_logprobs
from k3verify.api.errors import APIError, engine_unavailable, error_response, install_error_handlers
from k3verify.api.generation import generate
from k3verify.api.hosts import LOOPBACK_HOSTS, CheckHost
from k3verify.api.metrics import ServerMetrics
from k3verify.api.middleware import CountRequests
from k3verify.api.protocol import ChatCompletionRequest, CompletionRequest, check_logit_bias, parse_request
from k3verify.api.render import CompletionRenderer, ModelCard, ModelList, make_id, unix_time
from k3verify.api.state import ChatEncoder, ServedEngine, ServerState, state_of, template_chat_encoder
from k3verify.api.tokenize import detokenize, tokenize
from k3verify.tokenizer.tool_calls import ToolCallParser

DEFAULT_COMPLETION_TOKENS = 16
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics")


def api_key_problem(api_key: str | None) -> str | None:
    """Why a configured key could never be presented as `Authorization: Bearer <key>` (None: it can). Refused, not
    normalised: whitespace at either end cannot survive a header (HTTP strips it), and quietly serving with
    another key than the one configured would be a silent fallback on a secret."""
    if api_key is None:
        return None
    if not api_key.strip():
        return "must be a non-empty string (None disables authentication)"
    if api_key != api_key.strip():
        return (f"has whitespace at its start or end ({len(api_key) - len(api_key.lstrip())} leading, "
                f"{len(api_key) - len(api_key.rstrip())} trailing): a client's bearer token cannot carry it, so no "
                "client could authenticate; remove it")
    if not all(" " <= c <= "~" for c in api_key):
        return "holds characters outside printable ASCII, which an HTTP header cannot carry reliably"
    return None


def check_auth(request: Request) -> None:
    """401 unless the app has no API key or the request sends `Authorization: Bearer <key>`."""
    api_key = state_of(request).api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                       type="invalid_request_error", code="invalid_api_key")


async def completions(request: Request) -> Response:
    """POST /v1/completions: one prompt (text or token ids), JSON or SSE; echo=true starts the answer with the
    prompt (and, with logprobs, the prompt's own logprobs)."""
    state = state_of(request)
    req = parse_request(CompletionRequest, await read_json(request))
    state.check_model(req.model)
    prompt = req.single_prompt
    ids = await asyncio.to_thread(state.tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
    renderer = CompletionRenderer(make_id("cmpl"), unix_time(), state.model_name, state.engine.token_text,
                                  want_logprobs=req.logprobs is not None, include_usage=req.include_usage,
                                  token_ids_as_text=req.return_tokens_as_token_ids)
    max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
    params = req.sampling_params(max_tokens, req.logprobs)
    check_logit_bias(params, state.engine.vocab_size)
    if req.echo:
        echoed = [] if req.logprobs is None else await echo_logprobs(state.engine, ids, req.logprobs, max_tokens)
        text = prompt if isinstance(prompt, str) else \
            b"".join(state.engine.token_text.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
        renderer.echo(ids, text, echoed)
    return await generate(state, request, ids, params, renderer, stream=req.stream, prompt_param="prompt")


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions: messages rendered by the chat encoder; without max_tokens, what still fits
    (capped at default_max_tokens: the runner reserves cache for prompt + max_tokens at admission)."""
    state = state_of(request)
    req = parse_request(ChatCompletionRequest, await read_json(request))
    state.check_model(req.model)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        ids = await asyncio.to_thread(state.encode_chat, messages, tools)
    except ValueError as exc:
        raise APIError(400, f"messages could not be rendered: {exc}", param="messages") from None
    fits = state.engine.max_new_tokens_for(len(ids))
    max_tokens = req.max_new_tokens or max(1, min(state.default_max_tokens, fits))
    renderer = ChatRenderer(make_id("chatcmpl"), unix_time(), state.model_name, state.engine.token_text,
                            want_logprobs=req.logprobs, include_usage=req.include_usage,
                            token_ids_as_text=req.return_tokens_as_token_ids,
                            tool_parser=state.tool_parser if req.parse_tool_calls else None)
    params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    check_logit_bias(params, state.engine.vocab_size)
    return await generate(state, request, ids, params, renderer, stream=req.stream, prompt_param="messages")


async def list_models(request: Request) -> JSONResponse:
    """GET /v1/models: the one model this server serves."""
    state = state_of(request)
    card = ModelCard(id=state.model_name, created=unix_time(), max_model_len=state.engine.limits.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


async def health(request: Request) -> JSONResponse:
    """GET /health: 200 "ok" or "degraded" (still serving: recent restarts or non-finite failures, with reasons)
    with the engine's load and counts; 503 when unhealthy (loop dead or stalled, or non-finite failures past
    the operator's threshold), the reasons in the envelope's message."""
    engine = state_of(request).engine
    status = engine.status()
    if status.state == "unhealthy":
        return error_response(engine_unavailable("; ".join(status.reasons)))
    return JSONResponse(status.as_dict() | {"waiting": engine.num_waiting, "running": engine.num_running})


async def prometheus_metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text exposition."""
    metrics = state_of(request).metrics
    return Response(await asyncio.to_thread(metrics.render), media_type=metrics.content_type)


def create_app(engine: ServedEngine, tokenizer: Any, *, model_name: str, api_key: str | None = None,
               metrics: ServerMetrics | None = None, default_max_tokens: int = 1024,
               encode_chat: ChatEncoder | None = None,
               allowed_hosts: Collection[str] = LOOPBACK_HOSTS) -> FastAPI:
    """The FastAPI app; `encode_chat` defaults to the tokenizer's own chat template (k3verify.tokenizer).
    A chat request without max_tokens gets what still fits, capped at default_max_tokens: the runner reserves
    cache for prompt + max_tokens at admission, so an uncapped default would serialize all such requests.
    Requests whose Host is not in `allowed_hosts` (normalised by api/hosts.py) get 421."""
    problem = api_key_problem(api_key)
    if problem is not None:
        raise ValueError(f"api_key {problem}")
    redact_access_log()
    metrics = metrics or ServerMetrics()
    if encode_chat is None:
        encode_chat = template_chat_encoder(tokenizer)
    app = FastAPI(title="k3verify", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(
        engine=engine, tokenizer=tokenizer, encode_chat=encode_chat,
        model_name=model_name, api_key=api_key, metrics=metrics, default_max_tokens=default_max_tokens,
        tool_parser=ToolCallParser.for_tokenizer(tokenizer))
    install_error_handlers(app)
    authorized = [Depends(check_auth)]
    app.add_api_route("/v1/completions", completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/models", list_models, methods=["GET"], dependencies=authorized)
    app.add_api_route("/tokenize", tokenize, methods=["POST"], dependencies=authorized)
    app.add_api_route("/detokenize", detokenize, methods=["POST"], dependencies=authorized)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    app.add_middleware(CheckHost, allowed=allowed_hosts)
    app.add_middleware(CountRequests, metrics=metrics, routes=ROUTES)  # outermost: a 421 is counted too
    return app
