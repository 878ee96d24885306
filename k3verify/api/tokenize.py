"""vLLM-style `/tokenize` and `/detokenize`: the ids this server would feed the model for a prompt or a chat.

`/tokenize` takes `{"prompt": str}` (the ids a text completion uses) or `{"messages": [...]}` (the ids a chat
completion uses, under the same chat encoder) and answers `{"count", "max_model_len", "tokens", "token_strs"}`.
The tokenizer adds no special tokens to plain text (neither do completions), so `add_special_tokens` changes
nothing here; it is accepted because vLLM clients send it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from k3verify.api.body import read_json
from k3verify.api.errors import APIError
from k3verify.api.protocol import ChatMessage, _Strict, parse_request
from k3verify.api.state import ServerState, state_of


class TokenizePrompt(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(_Strict):
    model: str | None = None
    tokens: list[int]


def _token_strs(state: ServerState, ids: list[int]) -> list[str]:
    return [state.engine.token_text.token_bytes(t).decode("utf-8", errors="replace") for t in ids]


async def tokenize(request: Request) -> JSONResponse:
    """POST /tokenize: prompt or chat messages -> the prompt ids this server would use."""
    state = state_of(request)
    data = await read_json(request)
    req: TokenizePrompt | TokenizeChat
    if isinstance(data, dict) and "messages" in data:
        req = parse_request(TokenizeChat, data)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        if not req.add_generation_prompt:
            raise APIError(400, "add_generation_prompt=false is not supported: chat prompts always end with the "
                                "assistant turn marker", param="add_generation_prompt")
        try:
            ids = await asyncio.to_thread(state.encode_chat, messages, None)
        except ValueError as exc:
            raise APIError(400, f"messages could not be rendered: {exc}", param="messages") from None
    else:
        req = parse_request(TokenizePrompt, data)
        ids = await asyncio.to_thread(state.tokenizer.encode, req.prompt)
    if req.model is not None:
        state.check_model(req.model)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.limits.max_model_len, "tokens": ids,
                            "token_strs": _token_strs(state, ids) if req.return_token_strs else None}
    return JSONResponse(body)


async def detokenize(request: Request) -> JSONResponse:
    """POST /detokenize: token ids -> text (special tokens kept, as vLLM does)."""
    state = state_of(request)
    req = parse_request(Detokenize, await read_json(request))
    if req.model is not None:
        state.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < state.engine.vocab_size]
    if bad:
        raise APIError(400, f"token ids must be in [0, {state.engine.vocab_size}); got {bad[:5]}", param="tokens")
    raw = b"".join(state.engine.token_text.token_bytes(t) for t in req.tokens)
    return JSONResponse({"prompt": raw.decode("utf-8", errors="replace")})
