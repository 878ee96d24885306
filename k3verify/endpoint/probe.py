"""What an OpenAI-compatible server offers, found by asking it (about ten small requests), never assumed.

Each optional feature the checks use is probed with one request whose answer shows whether the server really
applies it (not merely accepts it): token ids in logprobs (an `id` per entry, or vLLM's `token_id:N`), echo with
prompt logprobs, logit_bias, chat, a tokenize endpoint (prompt and chat forms; vLLM and SGLang read `prompt`,
llama.cpp reads `content`), and llama.cpp's native `/completion` with every generated id. A missing feature makes
the checks that need it skip with the reason recorded here, never fail.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from k3verify.endpoint.client import EndpointClient, Reply
from k3verify.endpoint.wire import LOGPROB_FORMS, Answer, TokenResolver, WireError, parse_completion

TOKENIZE_PATHS = ("/tokenize", "/v1/tokenize")  # vLLM, SGLang, llama.cpp
TOKENIZE_FIELDS = ("prompt", "content")  # vLLM and SGLang read `prompt`; llama.cpp reads `content`
NATIVE_PATH = "/completion"  # llama.cpp: every generated id, apart from the logprobs that may leave some out


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
    native_ids: Feature = Feature(False, "not probed")  # llama.cpp's /completion with return_tokens
    tokenize_field: str = "prompt"  # the body field the tokenize endpoint reads
    logprob_form: str = "none"  # wire.LOGPROB_FORMS: the form /v1/completions answers logprobs in

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServerIdentity:
    """Which server answered: its /v1/models listing and the identifying headers of that answer."""

    models: list[dict[str, Any]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    props: dict[str, Any] = field(default_factory=dict)  # llama.cpp's GET /props: build, model file, slots, context


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
    return model, ServerIdentity([dict(c) for c in cards], reply.headers, _props(client))


PROPS = ("build_info", "model_path", "model_ftype", "total_slots")


def _props(client: EndpointClient) -> dict[str, Any]:
    """What llama.cpp's GET /props says of the build and the model file (empty for servers without it)."""
    reply = client.get("/props")
    if not reply.ok or not isinstance(reply.body, Mapping):
        return {}
    out = {k: reply.body[k] for k in PROPS if k in reply.body}
    settings = reply.body.get("default_generation_settings")
    if isinstance(settings, Mapping) and "n_ctx" in settings:
        out["n_ctx"] = settings["n_ctx"]
    return out


def _answer(reply: Reply, resolver: TokenResolver) -> Answer | None:
    """The completion's answer when it parses and carries logprobs for its token; None otherwise."""
    return _parsed(reply, resolver)[0]


def _parsed(reply: Reply, resolver: TokenResolver) -> tuple[Answer | None, str]:
    """(the answer, "") when it parses and carries logprobs for its token; else (None, why not)."""
    try:
        answer = parse_completion(resolver, reply.body)
    except WireError as exc:
        return None, f"its answer does not parse ({exc})"
    return (answer, "") if answer.steps else (None, "")


def _missing(what: str, reply: Reply) -> Feature:
    return Feature(False, f"{what}: the server answered {reply.error_message()[:300]}")


def probe(client: EndpointClient, model: str, prompt: list[int], forced_token: int,
          resolver: TokenResolver) -> Capabilities:
    """Probe every optional feature with `prompt` (a few token ids); `forced_token` is what logit_bias forces."""
    base = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    plain = client.post("/v1/completions", base)
    answer, why = _parsed(plain, resolver) if plain.ok else (None, "")
    if answer is None:
        completions = _missing("completions with a token-id prompt and logprobs", plain) if not plain.ok else \
            Feature(False, f"completions answered without logprobs this package can read: "
                           f"{why or str(plain.body)[:200]}")
        off = Feature(False, f"needs completions with logprobs, which failed ({completions.reason})")
        return Capabilities(completions, off, off, off, _chat(client, model), off, off,
                            native_ids=_native(client, prompt))
    completions = Feature(True, f"token-id prompts with logprobs ({LOGPROB_FORMS[answer.wire]})")
    extra: dict[str, Any] = {}
    form = answer.wire
    if answer.wire == "content+id":
        token_ids = Feature(True, "each logprobs entry carries its token's id")
    else:
        ids_reply = client.post("/v1/completions", {**base, "return_tokens_as_token_ids": True})
        with_ids = _answer(ids_reply, resolver) if ids_reply.ok else None
        if not ids_reply.ok:
            token_ids = _missing("return_tokens_as_token_ids", ids_reply)
        elif with_ids is not None and with_ids.wire == "legacy+token_id":
            token_ids = Feature(True, "return_tokens_as_token_ids gives 'token_id:N'")
            extra, form = {"return_tokens_as_token_ids": True}, with_ids.wire
        else:
            token_ids = Feature(False, "return_tokens_as_token_ids was accepted but tokens came back as text")
    tokenize, tokenize_chat, path, field = _tokenize(client, model)
    return Capabilities(completions, token_ids, _echo(client, base | extra, len(prompt)),
                        _logit_bias(client, base | extra, forced_token, resolver), _chat(client, model),
                        tokenize, tokenize_chat, path, _native(client, prompt), field, form)


def _native(client: EndpointClient, prompt: list[int]) -> Feature:
    reply = client.post(NATIVE_PATH, {"prompt": prompt, "n_predict": 1, "temperature": 0, "n_probs": 1,
                                      "return_tokens": True})
    if not reply.ok:
        return _missing(f"{NATIVE_PATH} (llama.cpp's native completion)", reply)
    tokens = reply.body.get("tokens") if isinstance(reply.body, Mapping) else None
    if not isinstance(tokens, list) or len(tokens) != 1:
        return Feature(False, f"{NATIVE_PATH} answered without one generated id in `tokens`: {str(reply.body)[:160]}")
    return Feature(True, f"{NATIVE_PATH} with return_tokens lists every generated id")


def _echo(client: EndpointClient, base: dict[str, Any], prompt_len: int) -> Feature:
    reply = client.post("/v1/completions", {**base, "echo": True})
    if not reply.ok:
        return _missing("echo with logprobs", reply)
    try:
        values = reply.body["choices"][0]["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        return Feature(False, "echo=true answered without logprobs.token_logprobs")
    if not isinstance(values, list) or len(values) < 2:
        return Feature(False, f"echo=true answered logprobs.token_logprobs that is not a list of positions: "
                              f"{str(values)[:120]}")
    if len(values) != prompt_len + 1 or values[0] is not None or values[1] is None:
        return Feature(False, f"echo=true gave {len(values)} logprob positions (expected {prompt_len} prompt + 1 "
                              f"generated, the first null): {str(values)[:120]}")
    return Feature(True, "echo=true returns prompt logprobs (first null)")


def _logit_bias(client: EndpointClient, base: dict[str, Any], forced: int, resolver: TokenResolver) -> Feature:
    reply = client.post("/v1/completions", {**base, "logit_bias": {str(forced): 100}})
    if not reply.ok:
        return _missing("logit_bias", reply)
    answer = _answer(reply, resolver)
    got = answer.steps[0].token_id if answer is not None else None
    if got == forced:
        return Feature(True, f"logit_bias +100 on token {forced} makes it the answer")
    return Feature(False, f"logit_bias +100 on token {forced} was accepted but not applied (answer: {got!r})")


def _chat(client: EndpointClient, model: str) -> Feature:
    reply = client.post("/v1/chat/completions", {"model": model, "max_tokens": 1, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    if not reply.ok:
        return _missing("chat completions", reply)
    usage = reply.body.get("usage") if isinstance(reply.body, Mapping) else None
    if not isinstance(usage, Mapping) or "prompt_tokens" not in usage:
        return Feature(False, "chat completions answered without usage.prompt_tokens")
    return Feature(True, "chat completions with usage")


def _tokenize(client: EndpointClient, model: str) -> tuple[Feature, Feature, str | None, str]:
    """(prompt form, chat form, path, body field): the first path and field that tokenize a word to >= 1 id."""
    tried = []
    for path in TOKENIZE_PATHS:
        for key in TOKENIZE_FIELDS:
            reply = client.post(path, {"model": model, key: "hello"})
            tokens = reply.body.get("tokens") if reply.ok and isinstance(reply.body, Mapping) else None
            if isinstance(tokens, list) and tokens:
                chat = client.post(path, {"model": model, "messages": [{"role": "user", "content": "hi"}]})
                listed = chat.body.get("tokens") if chat.ok and isinstance(chat.body, Mapping) else None
                chat_feature = Feature(True, f"{path} with messages") if isinstance(listed, list) and listed else \
                    Feature(False, f"{path} with messages gave no tokens ({chat.error_message()[:120]})")
                return Feature(True, f"{path} with `{key}`"), chat_feature, path, key
            tried.append(f"{path} `{key}` -> {reply.error_message()[:100]}")
            if reply.status == 404:
                break  # no such path: its other field will not exist either
    missing = Feature(False, f"no tokenize endpoint ({'; '.join(tried)})")
    return missing, missing, None, "prompt"
