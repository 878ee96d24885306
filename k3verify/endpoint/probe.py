"""What an OpenAI-compatible server offers, found by asking it (about ten small requests), never assumed.

Each optional feature the checks use is probed with one request whose answer shows whether the server really
applies it (not merely accepts it): token ids in logprobs, echo with prompt logprobs, logit_bias, chat, a
tokenize endpoint (prompt and chat forms). A missing feature makes the checks that need it skip with the
reason recorded here, never fail.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from k3verify.endpoint.client import EndpointClient, Reply
from k3verify.endpoint.wire import TOKEN_ID_PREFIX, TokenResolver

TOKENIZE_PATHS = ("/tokenize", "/v1/tokenize")  # vLLM, SGLang


@dataclass(frozen=True)
class Feature:
    available: bool
    reason: str


@dataclass
class Capabilities:
    completions: Feature
    token_ids: Feature
    echo_logprobs: Feature
    logit_bias: Feature
    chat: Feature
    tokenize: Feature
    tokenize_chat: Feature
    tokenize_path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServerIdentity:
    """Which server answered: its /v1/models listing and the identifying headers of that answer."""

    models: list[dict[str, Any]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)


class SetupError(RuntimeError):
    """The endpoint cannot be verified at all (unreachable, unauthorized, no such model)."""


def identify(client: EndpointClient, model: str | None) -> tuple[str, ServerIdentity]:
    """(model to use, identity): --model if given (it must be listed), else the only/first listed model."""
    reply = client.get("/v1/models")
    if not reply.ok:
        raise SetupError(f"GET {client.root}/v1/models: {reply.error_message()}")
    cards = reply.body.get("data") if isinstance(reply.body, Mapping) else None
    if not isinstance(cards, list) or not all(isinstance(c, Mapping) and "id" in c for c in cards):
        raise SetupError(f"GET {client.root}/v1/models: expected {{'data': [{{'id': ...}}, ...]}}; "
                         f"got {str(reply.body)[:200]}")
    ids = [str(c["id"]) for c in cards]
    if model is None:
        if not ids:
            raise SetupError(f"{client.root} lists no models; pass --model NAME")
        model = ids[0]
    elif model not in ids:
        raise SetupError(f"--model {model!r} is not served by {client.root}; it lists {ids}")
    return model, ServerIdentity([dict(c) for c in cards], reply.headers)


def _answer_tokens(reply: Reply) -> list[Any] | None:
    try:
        tokens = reply.body["choices"][0]["logprobs"]["tokens"]
    except (KeyError, IndexError, TypeError):
        return None
    return tokens if isinstance(tokens, list) else None


def _missing(what: str, reply: Reply) -> Feature:
    return Feature(False, f"{what}: the server answered {reply.error_message()[:300]}")


def probe(client: EndpointClient, model: str, prompt: list[int], forced_token: int,
          resolver: TokenResolver) -> Capabilities:
    """Probe every optional feature with `prompt` (a few token ids); `forced_token` is what logit_bias forces."""
    base = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    plain = client.post("/v1/completions", base)
    if not plain.ok or _answer_tokens(plain) is None:
        completions = _missing("completions with a token-id prompt and logprobs", plain)
        off = Feature(False, f"needs completions with logprobs, which failed ({completions.reason})")
        return Capabilities(completions, off, off, off, _chat(client, model), off, off)
    completions = Feature(True, "token-id prompts with logprobs")
    ids_reply = client.post("/v1/completions", {**base, "return_tokens_as_token_ids": True})
    tokens = _answer_tokens(ids_reply)
    if not ids_reply.ok:
        token_ids = _missing("return_tokens_as_token_ids", ids_reply)
    elif tokens and str(tokens[0]).startswith(TOKEN_ID_PREFIX):
        token_ids = Feature(True, "return_tokens_as_token_ids gives 'token_id:N'")
    else:
        token_ids = Feature(False, "return_tokens_as_token_ids was accepted but tokens came back as text")
    extra = {"return_tokens_as_token_ids": True} if token_ids.available else {}
    return Capabilities(completions, token_ids, _echo(client, base | extra, len(prompt)),
                        _logit_bias(client, base | extra, forced_token, resolver), _chat(client, model),
                        *_tokenize(client, model))


def _echo(client: EndpointClient, base: dict[str, Any], prompt_len: int) -> Feature:
    reply = client.post("/v1/completions", {**base, "echo": True})
    if not reply.ok:
        return _missing("echo with logprobs", reply)
    try:
        values = reply.body["choices"][0]["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        return Feature(False, "echo=true answered without logprobs.token_logprobs")
    if len(values) != prompt_len + 1 or values[0] is not None or values[1] is None:
        return Feature(False, f"echo=true gave {len(values)} logprob positions (expected {prompt_len} prompt + 1 "
                              f"generated, the first null): {str(values)[:120]}")
    return Feature(True, "echo=true returns prompt logprobs (first null)")


def _logit_bias(client: EndpointClient, base: dict[str, Any], forced: int, resolver: TokenResolver) -> Feature:
    reply = client.post("/v1/completions", {**base, "logit_bias": {str(forced): 100}})
    if not reply.ok:
        return _missing("logit_bias", reply)
    tokens = _answer_tokens(reply)
    got = resolver.resolve(str(tokens[0])) if tokens else None
    if got == forced:
        return Feature(True, f"logit_bias +100 on token {forced} makes it the answer")
    return Feature(False, f"logit_bias +100 on token {forced} was accepted but not applied (answer: "
                          f"{tokens[0] if tokens else None!r})")


def _chat(client: EndpointClient, model: str) -> Feature:
    reply = client.post("/v1/chat/completions", {"model": model, "max_tokens": 1, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    if not reply.ok:
        return _missing("chat completions", reply)
    usage = reply.body.get("usage") if isinstance(reply.body, Mapping) else None
    if not isinstance(usage, Mapping) or "prompt_tokens" not in usage:
        return Feature(False, "chat completions answered without usage.prompt_tokens")
    return Feature(True, "chat completions with usage")


def _tokenize(client: EndpointClient, model: str) -> tuple[Feature, Feature, str | None]:
    tried = []
    for path in TOKENIZE_PATHS:
        reply = client.post(path, {"model": model, "prompt": "hello"})
        if reply.ok and isinstance(reply.body, Mapping) and isinstance(reply.body.get("tokens"), list):
            chat = client.post(path, {"model": model, "messages": [{"role": "user", "content": "hi"}]})
            ok = chat.ok and isinstance(chat.body, Mapping) and isinstance(chat.body.get("tokens"), list)
            chat_feature = Feature(True, f"{path} with messages") if ok else \
                _missing(f"{path} with messages", chat)
            return Feature(True, f"{path} with a prompt"), chat_feature, path
        tried.append(f"{path} -> {reply.error_message()[:120]}")
    missing = Feature(False, f"no tokenize endpoint ({'; '.join(tried)})")
    return missing, missing, None
