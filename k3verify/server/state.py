"""What every handler of one app shares: engine, tokenizer, chat encoder, model name, API key, metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from k3verify.server.errors import APIError
from k3verify.server.metrics import ServerMetrics
from k3verify.serving.engine import Engine
from k3verify.tokenizer.tool_calls import ToolCallParser

ChatEncoder = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]  # (messages, tools) -> ids


class PromptTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


def template_chat_encoder(tokenizer: Any) -> ChatEncoder:
    """Chat messages (and tool definitions) → prompt ids under the tokenizer's own chat template, rendered with
    Jinja in a sandbox with user text protected (k3verify.tokenizer)."""
    from k3verify.tokenizer import encode_chat

    def encode(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return encode_chat(tokenizer, messages, tools=tools)

    return encode


@dataclass(frozen=True)
class ServerState:
    """One app's shared state, kept on `app.state.server` (default_max_tokens: see create_app)."""

    engine: Engine
    tokenizer: PromptTokenizer
    encode_chat: ChatEncoder
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    default_max_tokens: int
    tool_parser: ToolCallParser | None = None  # generated tool calls -> `tool_calls` (markers in the tokenizer)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")


def state_of(request: Request) -> ServerState:
    """The shared state of the app serving `request`."""
    state: ServerState = request.app.state.server
    return state
