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


def _choice(body: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise WireError(f"{where}: expected an object with a non-empty `choices` list; got {str(body)[:200]}")
    choice = body["choices"][0]
    if not isinstance(choice, Mapping):
        raise WireError(f"{where}: choices[0] is not an object: {str(choice)[:200]}")
    return choice


def _top_map(resolver: TokenResolver, top: Mapping[str, float] | None) -> tuple[dict[int, float], int]:
    out, unresolved = {}, 0
    for name, value in (top or {}).items():
        token_id = resolver.resolve(name)
        if token_id is None:
            unresolved += 1
        else:
            out[token_id] = float(value)
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
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    tops = logprobs.get("top_logprobs") or [None] * len(tokens or [])
    if not isinstance(tokens, list) or not isinstance(values, list) or not len(tokens) == len(values) == len(tops):
        raise WireError(f"{where}: logprobs.tokens / token_logprobs / top_logprobs must be equal-length lists")
    steps = []
    for token, value, top in zip(tokens, values, tops, strict=True):
        ids, unresolved = _top_map(resolver, top)
        steps.append(Step(resolver.resolve(str(token)), None if value is None else float(value), ids, unresolved))
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
    return Answer(str(choice.get("text") or ""), choice.get("finish_reason"), steps, prompt_steps, body.get("usage"),
                  form)


def chat_steps(resolver: TokenResolver, logprobs: Mapping[str, Any] | None) -> list[Step]:
    """Steps of a chat `logprobs` object {content: [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    steps = []
    for entry in (logprobs or {}).get("content") or []:
        top, unresolved = {}, 0
        for alt in entry.get("top_logprobs") or []:
            alt_id = resolver.resolve(str(alt.get("token", "")), alt.get("bytes"), alt.get("id"))
            if alt_id is None:
                unresolved += 1
            else:
                top[alt_id] = float(alt["logprob"])
        token_id = resolver.resolve(str(entry.get("token", "")), entry.get("bytes"), entry.get("id"))
        steps.append(Step(token_id, float(entry["logprob"]), top, unresolved))
    return steps


def parse_chat(resolver: TokenResolver, body: Any) -> Answer:
    choice = _choice(body, "chat completion")
    message = choice.get("message") or {}
    steps, form = logprob_steps(resolver, choice.get("logprobs"), "chat completion")
    return Answer(str(message.get("content") or ""), choice.get("finish_reason"), steps, None, body.get("usage"), form)


def parse_stream(resolver: TokenResolver, events: Sequence[Any], *, chat: bool) -> Answer:
    """The chunks of one streamed answer joined: text, steps, the last finish_reason, the usage chunk's usage."""
    text, steps, finish, usage, form = [], [], None, None, "none"
    for event in events:
        if isinstance(event, Mapping) and "error" in event:
            raise WireError(f"stream carried an error event: {str(event['error'])[:300]}")
        if isinstance(event, Mapping) and event.get("usage"):
            usage = event["usage"]
        for choice in (event.get("choices") or []) if isinstance(event, Mapping) else []:
            text.append(((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or "")
            chunk_steps, chunk_form = logprob_steps(resolver, choice.get("logprobs"), "stream")
            steps.extend(chunk_steps)
            form = chunk_form if chunk_form != "none" else form
            finish = choice.get("finish_reason") or finish
    return Answer("".join(text), finish, steps, None, usage, form)


NATIVE_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


def parse_native(resolver: TokenResolver, body: Any) -> Answer:
    """llama.cpp's native `/completion` answer with `return_tokens` and `n_probs`: every generated id in `tokens`,
    their logprobs in `completion_probabilities` (chat-style entries with ids), usage from its own counters."""
    if not isinstance(body, Mapping) or not isinstance(body.get("tokens"), list):
        raise WireError(f"/completion: expected an object with a `tokens` list (return_tokens); got {str(body)[:200]}")
    ids = [int(t) for t in body["tokens"]]
    steps = chat_steps(resolver, {"content": body.get("completion_probabilities") or []})
    usage = {"completion_tokens": body.get("tokens_predicted", len(ids)), "prompt_tokens": body.get("tokens_evaluated")}
    stop = body.get("stop_type")
    finish = NATIVE_FINISH.get(str(stop)) if stop is not None else ("stop" if body.get("stopped_eos") else None)
    return Answer(str(body.get("content") or ""), finish, steps, None, usage, "native", ids)
