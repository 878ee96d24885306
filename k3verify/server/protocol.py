"""OpenAI wire format: strict request models, response/chunk models, renderers, the error envelope.

Requests are strict (no type coercion, no NaN/Inf, unknown fields rejected) so a client's mistake
is a 400 naming the field, never a silently reinterpreted value or a 500.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from k3verify.serving.engine import EngineEvent
    from k3verify.serving.sampler import TokenLogprob

MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class APIError(Exception):
    """An error rendered as the OpenAI envelope `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _is_union_tag(part: object) -> bool:
    """pydantic puts the union member it tried into `loc` ('str', 'list[int]', 'TextPart'): not a field name."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper())


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field (dotted path) and value."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) if loc else None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: {param!r}", param=param)
    value = repr(err.get("input"))
    if len(value) > 80:
        value = value[:77] + "..."
    where = f"'{param}'" if param else "request body"
    return APIError(400, f"Invalid value for {where}: {err['msg']} (got {value})", param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Unsupported(ValueError):
    """Raised by model validators for a well-typed but unsupported value; carries the field name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="k3verify extension: -1 or 0 disables")
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="k3verify extension")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="k3verify extension: do not stop at eos ids")

    @model_validator(mode="after")
    def _check_supported(self) -> _SamplingFields:
        if self.n not in (None, 1):
            raise _Unsupported("n", f"n={self.n} is not supported: this server returns exactly one choice (n=1)")
        if self.stream_options is not None and not self.stream:
            raise _Unsupported("stream_options", "stream_options is only allowed when stream is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise _Unsupported(name, f"{name}={getattr(self, name)} is not supported (only 0)")
        if self.logit_bias:
            raise _Unsupported("logit_bias", "logit_bias is not supported")
        stops = self.stop_list
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _Unsupported("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed; got {len(stops)}")
        if any(s == "" for s in stops):
            raise _Unsupported("stop", "stop sequences must be non-empty strings")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo:
            raise _Unsupported("echo", "echo=true is not supported")
        if self.best_of not in (None, 1):
            raise _Unsupported("best_of", f"best_of={self.best_of} is not supported (only 1)")
        if self.suffix is not None:
            raise _Unsupported("suffix", "suffix is not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise _Unsupported("prompt", f"batched prompts are not supported: got {len(self.prompt)} prompts; "
                                             "send one request per prompt")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _Unsupported("top_logprobs", "top_logprobs requires logprobs=true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(model: type[_Strict], data: Any) -> Any:
    """Validate `data` (parsed JSON) into `model`, raising APIError(400) naming the field on failure."""
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object; got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # A model_validator's _Unsupported arrives wrapped: recover its param and message.
        for err in exc.errors(include_url=False):
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, _Unsupported):
                raise APIError(400, str(cause), param=cause.param) from None
        raise validation_error_to_api_error(exc) from None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
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


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
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


def now() -> int:
    return int(time.time())


LOGPROB_FLOOR = -9999.0  # JSON has no -inf


class TokenText(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class Renderer:
    """Turns engine events into one response (add/response) or SSE chunk payloads (start/chunks)."""

    chunk_model: type[CompletionResponse] | type[ChatCompletionChunk]

    def __init__(self, id: str, created: int, model: str, token_text: TokenText, *, want_logprobs: bool,
                 include_usage: bool) -> None:
        self.id, self.created, self.model, self.token_text = id, created, model, token_text
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.offsets: list[int] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def token(self, token_id: int) -> tuple[str, bytes]:
        raw = self.token_text.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def add(self, event: EngineEvent) -> None:
        for lp in event.logprobs:
            self.logprobs.append(lp)
            self.offsets.append(len(self.text))
        self.text += event.text
        if event.finished:
            self.finish_reason = event.finish_reason
            self.usage = Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                               total_tokens=event.prompt_tokens + event.completion_tokens)

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


class CompletionRenderer(Renderer):
    chunk_model = CompletionResponse

    def _logprobs(self, start: int = 0) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        entries = self.logprobs[start:]
        return CompletionLogprobs(
            tokens=[self.token(lp.token_id)[0] for lp in entries],
            token_logprobs=[max(lp.logprob, LOGPROB_FLOOR) for lp in entries],
            top_logprobs=[{self.token(t)[0]: max(v, LOGPROB_FLOOR) for t, v in lp.top} for lp in entries],
            text_offset=self.offsets[start:])

    def _chunk(self, text: str, first_logprob: int) -> dict[str, Any]:
        choice = CompletionChoice(text=text, finish_reason=self.finish_reason, logprobs=self._logprobs(first_logprob))
        return self._envelope([choice], None)

    def response(self) -> dict[str, Any]:
        choice = CompletionChoice(text=self.text, finish_reason=self.finish_reason, logprobs=self._logprobs())
        return self._envelope([choice], self.usage)


class ChatRenderer(Renderer):
    chunk_model = ChatCompletionChunk

    def _logprobs(self, start: int = 0) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None

        def top(token_id: int, logprob: float) -> dict[str, Any]:
            text, raw = self.token(token_id)
            return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(raw)}

        return ChatLogprobs(content=[
            ChatLogprobEntry(**top(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**top(t, v)) for t, v in lp.top])
            for lp in self.logprobs[start:]])

    def start(self) -> list[dict[str, Any]]:
        return [self._envelope([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))], None)]

    def _chunk(self, text: str, first_logprob: int) -> dict[str, Any]:
        delta = ChatDelta(content=text) if text else ChatDelta()
        return self._envelope([ChatChunkChoice(delta=delta, finish_reason=self.finish_reason,
                                               logprobs=self._logprobs(first_logprob))], None)

    def response(self) -> dict[str, Any]:
        if self.usage is None:
            raise RuntimeError("ChatRenderer.response() called before the final event")
        choice = ChatChoice(message=AssistantMessage(content=self.text), finish_reason=self.finish_reason,
                            logprobs=self._logprobs())
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=self.usage).model_dump()
