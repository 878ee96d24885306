"""OpenAI request bodies: strict request models, each error a 400 naming the field (reading and parsing the
body under limits: api/body.py).

Requests are strict (no type coercion, no NaN/Inf, unknown fields rejected) so a client's mistake
is a 400 naming the field, never a silently reinterpreted value or a 500.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from k3verify.api.errors import APIError
from k3verify.serving.sampler import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

MAX_STOP_SEQUENCES = 4


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


def parse_logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs: keys are token ids written as digit strings, values in [-100, 100]."""
    pairs = []
    for key, value in (raw or {}).items():
        if not key.isdigit():
            raise _Unsupported("logit_bias", f"logit_bias keys must be token ids (digit strings); got {key!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise _Unsupported("logit_bias", f"logit_bias values must be between -100 and 100; got {value} "
                                             f"for token {key}")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """400 naming logit_bias when it biases a token id the model does not have."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise APIError(400, f"logit_bias token ids must be in [0, {vocab_size}); got {bad[:5]}", param="logit_bias")


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="k3verify extension: -1 or 0 disables")
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="k3verify extension; checked against the vocabulary too")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="k3verify extension: do not stop at eos ids")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM extension: logprob tokens as 'token_id:N'")

    @model_validator(mode="after")
    def _check_supported(self) -> _SamplingFields:
        if self.n not in (None, 1):
            raise _Unsupported("n", f"n={self.n} is not supported: this server returns exactly one choice (n=1)")
        if self.stream_options is not None and not self.stream:
            raise _Unsupported("stream_options", "stream_options is only allowed when stream is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                raise _Unsupported(name, f"{name}={getattr(self, name)} is not supported (only 0)")
        parse_logit_bias(self.logit_bias)
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

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters for this request: unset temperature and top_p mean 1.0, unset top_k none.
        The fields' bounds mirror SamplingParams' own checks; a value they still refuse is a 400, never a 500."""
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                stop=tuple(self.stop_list), stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=logprobs,
                ignore_eos=self.ignore_eos, logit_bias=parse_logit_bias(self.logit_bias))
        except ValueError as exc:
            raise APIError(400, f"invalid sampling parameters: {exc}") from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_NEW_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo and self.stream:
            raise _Unsupported("echo", "echo=true is not supported with stream=true")
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
            return p[0]
        # Not a batch: _check_completion leaves a string or a flat list of token ids.
        return cast(str | list[int], p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


ACCEPTED_CONTENT = 'a string, or a list of text parts {"type": "text", "text": "..."}'


def content_part_problem(part: object) -> str | None:
    """Why one chat content part is not a text part (None: it is one)."""
    if not isinstance(part, dict):
        return f"is of type {type(part).__name__}, not an object"
    if part.get("type") != "text":
        return f"has type {part.get('type')!r}; only 'text' parts are accepted (no images, audio or files)"
    if not isinstance(part.get("text"), str):
        return f"has a 'text' that is {type(part.get('text')).__name__}, not a string"
    extra = sorted(set(part) - {"type", "text"})
    return f"has unknown field(s) {extra}" if extra else None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_content_parts(cls, data: Any) -> Any:
        """A bad content part is named (its index, what is wrong, what is accepted): pydantic's union error would
        only say that the content is not a valid string."""
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for i, part in enumerate(content):
                problem = content_part_problem(part)
                if problem is not None:
                    raise _Unsupported(f"content.{i}", f"content part {i} {problem}; content must be "
                                                        f"{ACCEPTED_CONTENT}")
        elif content is not None and not isinstance(content, str):
            raise _Unsupported("content", f"content is of type {type(content).__name__}; it must be {ACCEPTED_CONTENT}")
        return data

    @model_validator(mode="after")
    def _check_message(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _Unsupported("content", "content is missing: it may be null only in an assistant message with "
                                          "tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise _Unsupported("tool_calls", f"only assistant messages carry tool_calls (got role {self.role!r})")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise _Unsupported("tool_call_id", "tool_call_id is required in, and only in, tool messages")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _Unsupported("top_logprobs", "top_logprobs requires logprobs=true")
        if self.tool_choice not in (None, "auto", "none"):
            raise _Unsupported("tool_choice", f"tool_choice {self.tool_choice!r} is not supported (only 'auto' "
                                              "and 'none': the model decides, nothing forces a call)")
        return self

    @property
    def parse_tool_calls(self) -> bool:
        """Generated tool calls become `tool_calls` unless the client said tool_choice='none'."""
        return self.tool_choice != "none"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


RequestModel = TypeVar("RequestModel", bound=_Strict)


def parse_request(model: type[RequestModel], data: Any) -> RequestModel:
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
                where = [str(p) for p in err["loc"] if not _is_union_tag(p)]  # a nested model: messages.2
                raise APIError(400, str(cause), param=".".join([*where, cause.param])) from None
        raise validation_error_to_api_error(exc) from None
