"""What every handler of one app shares: engine, tokenizer, chat encoder, model name, API key, metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request

from k3verify.api.errors import APIError
from k3verify.api.metrics import ServerMetrics
from k3verify.serving.events import EngineEvent, TokenText
from k3verify.serving.health import HealthStatus
from k3verify.serving.request_limits import RequestLimits
from k3verify.serving.sampler import SamplingParams, TokenLogprob
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


class ServedEngine(Protocol):
    """What the HTTP layer needs of an engine: the Engine itself (serving/engine.py) in one process, or a
    RemoteEngine (api/engine_link.py) when the engine runs in a process of its own."""

    limits: RequestLimits
    vocab_size: int
    token_text: TokenText

    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[EngineEvent], None]) -> int: ...
    def abort(self, seq_id: int) -> None: ...
    def health(self) -> str | None: ...
    def status(self) -> HealthStatus: ...
    def validate(self, prompt_ids: list[int], max_tokens: int) -> None: ...
    def max_new_tokens_for(self, prompt_len: int) -> int: ...
    def prompt_logprobs(self, prompt_ids: list[int], num_top: int) -> list[TokenLogprob | None]: ...


@dataclass(frozen=True)
class ServerState:
    """One app's shared state, kept on `app.state.server` (default_max_tokens: see create_app)."""

    engine: ServedEngine
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
