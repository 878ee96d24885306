"""OpenAI answers as token ids: completions (plain, echo, streamed), chat completions (plain, streamed) and
llama.cpp's native `/completion`.

Logprobs come in two shapes, recognised by content, not by who the server claims to be: OpenAI's legacy
completions form `{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}` (vLLM, SGLang) and the
chat form `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, which llama.cpp also
answers completions with, each entry carrying the token's `id`.

Token identity is by id, never by text: two byte tokens can decode to the same replacement character. A token is
resolved from an `id` field where the server gives one, else from vLLM's `token_id:N` form
(return_tokens_as_token_ids), else from chat logprobs' `bytes`, else from its text only where exactly one
vocabulary entry decodes to that text cleanly; otherwise it stays unresolved (None) and the checks stop comparing
a sequence at its first unresolved token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

TOKEN_ID_PREFIX = "token_id:"
REPLACEMENT = "\ufffd"


class Vocabulary(Protocol):
    n_vocab: int

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class WireError(ValueError):
    """An answer that does not have the shape the OpenAI API (or the server's documented extension) gives it."""


class TokenResolver:
    """Maps a token as a server names it (`token_id:N`, bytes, or text) to its id, or None when ambiguous."""

    def __init__(self, vocab: Vocabulary) -> None:
        by_bytes: dict[bytes, list[int]] = defaultdict(list)
        for token_id in range(vocab.n_vocab):
            by_bytes[vocab.token_bytes(token_id)].append(token_id)
        self._by_bytes = {raw: ids[0] for raw, ids in by_bytes.items() if len(ids) == 1}
        by_text: dict[str, list[int]] = defaultdict(list)
        for raw, ids in by_bytes.items():
            text = raw.decode("utf-8", errors="replace")
            if REPLACEMENT not in text:
                by_text[text].extend(ids)
        self._by_text = {text: ids[0] for text, ids in by_text.items() if len(ids) == 1}

    def resolve(self, token: str, raw: Sequence[int] | None = None, token_id: object = None) -> int | None:
        if isinstance(token_id, int) and not isinstance(token_id, bool):
            return token_id
        if token.startswith(TOKEN_ID_PREFIX) and token[len(TOKEN_ID_PREFIX):].isdigit():
            return int(token[len(TOKEN_ID_PREFIX):])
        if raw is not None:
            return self._by_bytes.get(bytes(raw))
        return self._by_text.get(token)


@dataclass
class Step:
    """One position of an answer: the token there and its logprob, and the alternatives the server listed
    (only those it could be resolved to ids; `unresolved` counts the rest)."""

    token_id: int | None
    logprob: float | None
    top: dict[int, float] = field(default_factory=dict)
    unresolved: int = 0


@dataclass
class Answer:
    """A completion or chat completion reduced to what the checks compare."""

    text: str
    finish_reason: str | None
    steps: list[Step]
    prompt_steps: list[Step] | None = None  # echo=true: the prompt's own positions
    usage: dict[str, Any] | None = None
    wire: str = ""  # the logprobs form the answer came in (see LOGPROB_FORMS)
    all_ids: list[int] | None = None  # every generated id, where the server lists them apart from logprobs

    @property
    def completion_tokens(self) -> int | None:
        """usage.completion_tokens, when the server reported it."""
        value = (self.usage or {}).get("completion_tokens")
        return value if isinstance(value, int) else None

    @property
    def token_ids(self) -> list[int | None]:
        return [s.token_id for s in self.steps]

    def resolved_ids(self) -> list[int]:
        """The generated ids up to the first unresolved one."""
        out = []
        for step in self.steps:
            if step.token_id is None:
                break
            out.append(step.token_id)
        return out


def _obj(value: Any, where: str, *, optional: bool = False) -> Mapping[str, Any]:
    """`value` as a JSON object (an empty one for a missing optional value); WireError naming `where` otherwise."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise WireError(f"{where}: expected an object; got {type(value).__name__} {str(value)[:120]}")
    return value


def _list(value: Any, where: str, *, optional: bool = False) -> list[Any]:
    if value is None and optional:
        return []
    if not isinstance(value, list):
        raise WireError(f"{where}: expected a list; got {type(value).__name__} {str(value)[:120]}")
    return value


def _number(value: Any, where: str) -> float:
    """A logprob: a JSON number (NaN and Infinity, which some servers emit, are kept: the checks fail on them and
    the report shows them); a string, a bool or anything else is a WireError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(f"{where}: expected a number; got {type(value).__name__} {str(value)[:120]}")
    return float(value)


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WireError(f"{where}: expected a string; got {type(value).__name__} {str(value)[:120]}")
    return value


def _finish(value: Any, where: str) -> str | None:
    return None if value is None else _text(value, where)


def _usage(body: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    usage = body.get("usage")
    return None if usage is None else dict(_obj(usage, f"{where}: usage"))


def _choice(body: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise WireError(f"{where}: expected an object with a non-empty `choices` list; got {str(body)[:200]}")
    choice = body["choices"][0]
    if not isinstance(choice, Mapping):
        raise WireError(f"{where}: choices[0] is not an object: {str(choice)[:200]}")
    return choice


def _top_map(resolver: TokenResolver, top: Any, where: str) -> tuple[dict[int, float], int]:
    out, unresolved = {}, 0
    for name, value in _obj(top, where, optional=True).items():
        token_id = resolver.resolve(str(name))
        if token_id is None:
            unresolved += 1
        else:
            out[token_id] = _number(value, f"{where}[{str(name)[:40]!r}]")
    return out, unresolved


LOGPROB_FORMS = {
    "legacy": "OpenAI completions logprobs {tokens, token_logprobs, top_logprobs, text_offset}",
    "legacy+token_id": "OpenAI completions logprobs with tokens as 'token_id:N' (vLLM's return_tokens_as_token_ids)",
    "content": "chat-style logprobs.content[] resolved by bytes / text",
    "content+id": "chat-style logprobs.content[] with each token's id (llama.cpp)",
    "none": "no logprobs in the answer",
}


def logprob_form(logprobs: Any) -> str:
    """Which of LOGPROB_FORMS a `logprobs` object has (a WireError for anything else)."""
    if logprobs is None:
        return "none"
    if not isinstance(logprobs, Mapping):
        raise WireError(f"logprobs is not an object: {str(logprobs)[:200]}")
    if isinstance(logprobs.get("content"), list):
        entries = logprobs["content"]
        with_ids = bool(entries) and all(isinstance(e, Mapping) and isinstance(e.get("id"), int) for e in entries)
        return "content+id" if with_ids else "content"
    if isinstance(logprobs.get("tokens"), list):
        tokens = logprobs["tokens"]
        with_ids = bool(tokens) and all(str(t).startswith(TOKEN_ID_PREFIX) for t in tokens)
        return "legacy+token_id" if with_ids else "legacy"
    if not logprobs:
        return "none"
    raise WireError(f"logprobs has neither `content` nor `tokens`: keys {sorted(logprobs)[:8]}")


def logprob_steps(resolver: TokenResolver, logprobs: Any, where: str) -> tuple[list[Step], str]:
    """(steps, form) of a completions or chat `logprobs` object, whichever form it has."""
    form = logprob_form(logprobs)
    if form == "none":
        return [], form
    if form.startswith("content"):
        return chat_steps(resolver, logprobs), form
    return completion_steps(resolver, logprobs, where), form


def completion_steps(resolver: TokenResolver, logprobs: Mapping[str, Any] | None, where: str) -> list[Step]:
    """Steps of a completions `logprobs` object {tokens, token_logprobs, top_logprobs, text_offset}."""
    if logprobs is None:
        return []
    logprobs = _obj(logprobs, f"{where}: logprobs")
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    tops = logprobs.get("top_logprobs") or [None] * len(tokens if isinstance(tokens, list) else [])
    if not isinstance(tokens, list) or not isinstance(values, list) or not isinstance(tops, list) \
            or not len(tokens) == len(values) == len(tops):
        raise WireError(f"{where}: logprobs.tokens / token_logprobs / top_logprobs must be equal-length lists")
    steps = []
    for i, (token, value, top) in enumerate(zip(tokens, values, tops, strict=True)):
        ids, unresolved = _top_map(resolver, top, f"{where}: logprobs.top_logprobs[{i}]")
        logprob = None if value is None else _number(value, f"{where}: logprobs.token_logprobs[{i}]")
        steps.append(Step(resolver.resolve(_text(token, f"{where}: logprobs.tokens[{i}]")), logprob, ids, unresolved))
    return steps


def parse_completion(resolver: TokenResolver, body: Any, *, echo_len: int | None = None) -> Answer:
    """A /v1/completions body; with echo_len, its first echo_len logprob positions are the prompt's."""
    choice = _choice(body, "completion")
    steps, form = logprob_steps(resolver, choice.get("logprobs"), "completion")
    prompt_steps = None
    if echo_len is not None and steps:
        if len(steps) < echo_len:
            raise WireError(f"completion: echo=true answered {len(steps)} logprob positions for a prompt of "
                            f"{echo_len} tokens")
        prompt_steps, steps = steps[:echo_len], steps[echo_len:]
    return Answer(_text(choice.get("text"), "completion: text"), _finish(choice.get("finish_reason"), "completion: "
                  "finish_reason"), steps, prompt_steps, _usage(body, "completion"), form)


def chat_steps(resolver: TokenResolver, logprobs: Mapping[str, Any] | None) -> list[Step]:
    """Steps of a chat `logprobs` object {content: [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    steps = []
    for i, raw in enumerate(_list(_obj(logprobs, "logprobs", optional=True).get("content"), "logprobs.content",
                                  optional=True)):
        entry = _obj(raw, f"logprobs.content[{i}]")
        top, unresolved = {}, 0
        for j, raw_alt in enumerate(_list(entry.get("top_logprobs"), f"logprobs.content[{i}].top_logprobs",
                                          optional=True)):
            where = f"logprobs.content[{i}].top_logprobs[{j}]"
            alt = _obj(raw_alt, where)
            alt_id = resolver.resolve(_text(alt.get("token"), f"{where}.token"), _raw_bytes(alt.get("bytes"), where),
                                      alt.get("id"))
            if alt_id is None:
                unresolved += 1
            else:
                top[alt_id] = _number(alt.get("logprob"), f"{where}.logprob")
        where = f"logprobs.content[{i}]"
        token_id = resolver.resolve(_text(entry.get("token"), f"{where}.token"), _raw_bytes(entry.get("bytes"), where),
                                    entry.get("id"))
        steps.append(Step(token_id, _number(entry.get("logprob"), f"{where}.logprob"), top, unresolved))
    return steps


def _raw_bytes(value: Any, where: str) -> list[int] | None:
    """A token's `bytes` (a list of 0..255), or None when the server gives none."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256
                                              for b in value):
        raise WireError(f"{where}.bytes: expected a list of byte values; got {str(value)[:120]}")
    return value


def parse_chat(resolver: TokenResolver, body: Any) -> Answer:
    choice = _choice(body, "chat completion")
    message = _obj(choice.get("message"), "chat completion: message", optional=True)
    steps, form = logprob_steps(resolver, choice.get("logprobs"), "chat completion")
    return Answer(_text(message.get("content"), "chat completion: message.content"),
                  _finish(choice.get("finish_reason"), "chat completion: finish_reason"), steps, None,
                  _usage(body, "chat completion"), form)


def parse_stream(resolver: TokenResolver, events: Sequence[Any], *, chat: bool) -> Answer:
    """The chunks of one streamed answer joined: text, steps, the last finish_reason, the usage chunk's usage."""
    text, steps, finish, usage, form = [], [], None, None, "none"
    for n, raw in enumerate(events):
        event = _obj(raw, f"stream event {n}")
        if "error" in event:
            raise WireError(f"stream carried an error event: {str(event['error'])[:300]}")
        if event.get("usage"):
            usage = _usage(event, f"stream event {n}")
        for i, raw_choice in enumerate(_list(event.get("choices"), f"stream event {n}: choices", optional=True)):
            where = f"stream event {n}: choices[{i}]"
            choice = _obj(raw_choice, where)
            piece = _obj(choice.get("delta"), f"{where}.delta", optional=True).get("content") if chat \
                else choice.get("text")
            text.append(_text(piece, f"{where} text"))
            chunk_steps, chunk_form = logprob_steps(resolver, choice.get("logprobs"), "stream")
            steps.extend(chunk_steps)
            form = chunk_form if chunk_form != "none" else form
            finish = _finish(choice.get("finish_reason"), f"{where}.finish_reason") or finish
    return Answer("".join(text), finish, steps, None, usage, form)


NATIVE_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


def parse_native(resolver: TokenResolver, body: Any) -> Answer:
    """llama.cpp's native `/completion` answer with `return_tokens` and `n_probs`: every generated id in `tokens`,
    their logprobs in `completion_probabilities` (chat-style entries with ids), usage from its own counters."""
    if not isinstance(body, Mapping) or not isinstance(body.get("tokens"), list):
        raise WireError(f"/completion: expected an object with a `tokens` list (return_tokens); got {str(body)[:200]}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in body["tokens"]):
        raise WireError(f"/completion: `tokens` must list token ids (integers); got {str(body['tokens'])[:200]}")
    ids = list(body["tokens"])
    steps = chat_steps(resolver, {"content": _list(body.get("completion_probabilities"),
                                                   "/completion: completion_probabilities", optional=True)})
    usage = {"completion_tokens": body.get("tokens_predicted", len(ids)), "prompt_tokens": body.get("tokens_evaluated")}
    stop = body.get("stop_type")
    finish = NATIVE_FINISH.get(str(stop)) if stop is not None else ("stop" if body.get("stopped_eos") else None)
    return Answer(_text(body.get("content"), "/completion: content"), finish, steps, None, usage, "native", ids)
