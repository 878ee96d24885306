"""OpenAI response bodies: response and chunk models, renderers from engine events, SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from pydantic import BaseModel

if TYPE_CHECKING:
    from k3verify.serving.engine import EngineEvent
    from k3verify.serving.sampler import TokenLogprob

FinishReason = Literal["stop", "length", "tool_calls"]
LOGPROB_FLOOR = -9999.0  # JSON has no -inf
SSE_DONE = "data: [DONE]\n\n"
_TEMPLATE_TEXT = "\x00k3v-text\x00"  # a text no JSON key or value of a chunk contains (json.dumps: "\u0000...")


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache (docs/prefix-caching.md)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first echoed prompt token (nothing precedes it)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "k3verify"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def unix_time() -> int:
    return int(time.time())


def sse_event(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class TokenText(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class Renderer:
    """Turns engine events into one response (add/response) or SSE chunk payloads (start/chunks)."""

    chunk_model: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, id: str, created: int, model: str, token_text: TokenText, *, want_logprobs: bool,
                 include_usage: bool, token_ids_as_text: bool = False) -> None:
        self.id, self.created, self.model, self.token_text = id, created, model, token_text
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.token_ids_as_text = token_ids_as_text
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.offsets: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.usage: Usage | None = None

    def token(self, token_id: int) -> tuple[str, bytes]:
        """(name, bytes) of a token in logprobs: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids),
        which tells apart byte tokens that decode to the same replacement character."""
        raw = self.token_text.token_bytes(token_id)
        name = f"token_id:{token_id}" if self.token_ids_as_text else raw.decode("utf-8", errors="replace")
        return name, raw

    def add(self, event: EngineEvent) -> None:
        for lp in event.logprobs:
            self.logprobs.append(lp)
            self.offsets.append(len(self.text))
        self.text += event.text
        self.token_ids += event.token_ids
        if event.finished:
            # The engine finishes with "stop" or "length" only (and pydantic checks it again on rendering).
            self.finish_reason = cast(FinishReason | None, event.finish_reason)
            self.usage = Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                               total_tokens=event.prompt_tokens + event.completion_tokens,
                               prompt_tokens_details=PromptTokensDetails(cached_tokens=event.cached_tokens))

    def start(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, event: EngineEvent) -> list[dict[str, Any]]:
        start = len(self.logprobs)
        self.add(event)
        out = []
        if event.text or event.logprobs or event.finished:
            out.append(self._chunk(event.text, start))
        if event.finished and self.include_usage:
            out.append(self._envelope([], self.usage))
        return out

    _text_frame: tuple[str, str] | None = None

    def plain_deltas(self) -> bool:
        """Whether this stream's text deltas are chunks that differ only in their text (no logprobs asked, no
        tool-call parsing): sse_chunks then frames them from a template."""
        return False

    def sse_chunks(self, event: EngineEvent) -> list[str]:
        """The event's chunks as server-sent events (what a stream sends). A plain text delta (plain_deltas, not
        the last event) is the same event for every token but its text: framed from a template rendered once
        through the models (`_chunk`), so its bytes are the slow path's by construction (and by test). A stream
        sends one per token, and rendering each through pydantic and json.dumps is about a third of the server's
        work per streamed token: GIL time the engine thread waits for."""
        if not self.plain_deltas() or event.logprobs or event.finished or self.finish_reason is not None:
            return [sse_event(c) for c in self.chunks(event)]
        self.add(event)
        if not event.text:
            return []
        if self._text_frame is None:
            framed = sse_event(self._chunk(_TEMPLATE_TEXT, len(self.logprobs)))
            head, tail = framed.split(json.dumps(_TEMPLATE_TEXT))
            self._text_frame = (head, tail)
        head, tail = self._text_frame
        return [head + json.dumps(event.text) + tail]

    def response(self) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk(self, text: str, first_logprob: int) -> dict[str, Any]:
        raise NotImplementedError

    def _envelope(self, choices: list[Any], usage: Usage | None) -> dict[str, Any]:
        out = self.chunk_model(id=self.id, created=self.created, model=self.model, choices=choices,
                               usage=usage).model_dump()
        if usage is None and not self.include_usage:
            del out["usage"]
        return out


@dataclass(frozen=True)
class EchoedPrompt:
    """The prompt an echo=true completion starts with: ids, text offsets and (with logprobs) each prompt token
    scored given the tokens before it; the first has nothing before it (None, rendered as null)."""

    ids: list[int]
    offsets: list[int]
    logprobs: list[TokenLogprob | None]


class CompletionRenderer(Renderer):
    chunk_model = CompletionResponse
    echoed: EchoedPrompt | None = None

    def echo(self, prompt_ids: list[int], prompt_text: str, prompt_logprobs: list[TokenLogprob | None]) -> None:
        """Start the response with the prompt (echo=true; non-streamed responses only)."""
        offsets = [0]
        for token_id in prompt_ids[:-1]:
            offsets.append(offsets[-1] + len(self.token_text.token_bytes(token_id).decode(errors="replace")))
        self.text = prompt_text
        self.echoed = EchoedPrompt(prompt_ids, offsets, prompt_logprobs)

    def _logprobs(self, start: int = 0) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        prompt = self.echoed if start == 0 and self.echoed is not None else EchoedPrompt([], [], [])
        entries = self.logprobs[start:]

        def top(lp: TokenLogprob | None) -> dict[str, float] | None:
            return None if lp is None else {self.token(t)[0]: max(v, LOGPROB_FLOOR) for t, v in lp.top}

        return CompletionLogprobs(
            tokens=[self.token(t)[0] for t in prompt.ids] + [self.token(lp.token_id)[0] for lp in entries],
            token_logprobs=[None if lp is None else max(lp.logprob, LOGPROB_FLOOR) for lp in prompt.logprobs]
            + [max(lp.logprob, LOGPROB_FLOOR) for lp in entries],
            top_logprobs=[top(lp) for lp in prompt.logprobs] + [top(lp) for lp in entries],
            text_offset=prompt.offsets + self.offsets[start:])

    def _chunk(self, text: str, first_logprob: int) -> dict[str, Any]:
        choice = CompletionChoice(text=text, finish_reason=self.finish_reason, logprobs=self._logprobs(first_logprob))
        return self._envelope([choice], None)

    def plain_deltas(self) -> bool:
        return not self.want_logprobs

    def response(self) -> dict[str, Any]:
        choice = CompletionChoice(text=self.text, finish_reason=self.finish_reason, logprobs=self._logprobs())
        return self._envelope([choice], self.usage)
