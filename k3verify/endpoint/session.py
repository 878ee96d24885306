"""One endpoint under test: client, model, the precision it declares, what it offers, who it is.

`open_session` lists the models, picks one, and probes the optional features; the checks (gates/checks/
endpoint_*.py) then only ask the session to build request bodies and parse answers by token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import torch

from k3verify.endpoint.align import align_entries
from k3verify.endpoint.client import EndpointClient, Limits, Reply
from k3verify.endpoint.probe import NATIVE_PATH, Capabilities, ServerIdentity, identify, probe
from k3verify.endpoint.wire import (
    Answer,
    Step,
    TokenResolver,
    Vocabulary,
    parse_chat,
    parse_completion,
    parse_native,
    parse_stream,
)
from k3verify.oracle.conventions import Assignment
from k3verify.oracle.precision import PRECISIONS, Precision


@dataclass
class EndpointSession:
    url: str
    client: EndpointClient
    model: str
    precision: Precision  # what the endpoint declares it computes in (--dtype); the bars are taken at it
    caps: Capabilities
    identity: ServerIdentity
    resolver: TokenResolver
    vocab: Vocabulary
    note: str = ""
    accepted: list[Assignment] = field(default_factory=list)  # conventions the oracle is evaluated with
    excuse_roundings: bool = False  # rounding near-ties of the declared precision may be excused (opt-in)
    realigned: int = 0  # answers whose logprobs left positions out, put back by id from the native form
    unaligned: list[str] = field(default_factory=list)  # answers that could not be put back (their ids unreadable)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the oracle's run at the declared precision."""
        return self.precision.dtype

    def completion_body(self, prompt: Sequence[int], **fields: Any) -> dict[str, Any]:
        """A /v1/completions body with a token-id prompt; token ids in logprobs where the server offers them."""
        body: dict[str, Any] = {"model": self.model, "prompt": list(prompt), **fields}
        if self.caps.token_ids.available and "logprobs" in fields:
            body["return_tokens_as_token_ids"] = True
        return body

    def complete(self, prompt: Sequence[int], **fields: Any) -> Answer:
        """A non-streamed completion parsed by token id; a non-2xx answer raises EndpointAnswerError."""
        reply = self.client.post("/v1/completions", self.completion_body(prompt, **fields))
        echo_len = len(prompt) if fields.get("echo") and fields.get("logprobs") is not None else None
        answer = parse_completion(self.resolver, expect_ok(reply, "completion"), echo_len=echo_len)
        return self._every_position(prompt, answer, fields)

    def complete_streamed(self, prompt: Sequence[int], **fields: Any) -> Answer:
        reply, events = self.client.stream("/v1/completions", self.completion_body(prompt, stream=True, **fields))
        expect_ok(reply, "streamed completion")
        return self._every_position(prompt, parse_stream(self.resolver, events, chat=False), fields)

    def piece(self, token_id: int) -> bytes:
        """The bytes a token adds to generated text: special tokens add none."""
        return b"" if self.vocab.is_special(token_id) else self.vocab.token_bytes(token_id)

    def _every_position(self, prompt: Sequence[int], answer: Answer, fields: dict[str, Any]) -> Answer:
        """An answer with fewer logprobs entries than generated tokens (llama.cpp holds back a token that ends
        inside a UTF-8 character) spread over its positions by id (endpoint/align.py), the ids read from the
        native form of the same greedy request; where that cannot be done, no position is identified."""
        n = answer.completion_tokens
        if n is None or len(answer.steps) >= n or fields.get("logprobs") is None:
            return answer
        why = f"{len(answer.steps)} logprobs entries for {n} generated tokens"
        native = self.native_greedy(prompt, fields) if self.caps.native_ids.available else None
        steps = None if native is None or native.all_ids is None else \
            align_entries(answer.steps, native.all_ids, self.piece)
        if steps is None:
            self.unaligned.append(why + ("" if native is not None else
                                         f": no native form to read the ids from ({self.caps.native_ids.reason})"))
            return replace(answer, steps=[Step(None, None) for _ in range(n)])
        self.realigned += 1
        return replace(answer, steps=steps, all_ids=native.all_ids if native else None)

    def native_greedy(self, prompt: Sequence[int], fields: dict[str, Any]) -> Answer | None:
        """The same request through llama.cpp's native /completion (greedy requests only: a sampled one would not
        repeat), every generated id listed."""
        if fields.get("temperature") != 0:
            return None
        body: dict[str, Any] = {"prompt": list(prompt), "n_predict": fields.get("max_tokens", 16), "temperature": 0,
                                "n_probs": int(fields.get("logprobs") or 0), "return_tokens": True}
        body.update({k: fields[k] for k in ("stop", "logit_bias") if k in fields})
        reply = self.client.post(NATIVE_PATH, body)
        return parse_native(self.resolver, expect_ok(reply, "native completion"))

    def chat(self, messages: list[dict[str, Any]], **fields: Any) -> Answer:
        reply = self.client.post("/v1/chat/completions", {"model": self.model, "messages": messages, **fields})
        return parse_chat(self.resolver, expect_ok(reply, "chat completion"))

    def record(self) -> dict[str, Any]:
        """What report.json["run"]["endpoint"] says about this endpoint and the traffic sent to it."""
        stats = self.client.stats
        return {"accepted_conventions": [accepted_record(a) for a in self.accepted],
                "rounding_near_tie_excuse": self.excuse_roundings,
                "url": self.url, "model": self.model, "declared_dtype": self.precision.name,
                "precision": self.precision.description,
                "server": {"models": self.identity.models, "headers": self.identity.headers,
                           "props": self.identity.props},
                "capabilities": self.caps.as_dict(), "note": self.note,
                "logprob_entries_left_out": {"realigned": self.realigned, "unaligned": list(self.unaligned)},
                "limits": vars(self.client.limits).copy(),
                "requests": {"sent": stats.sent, "retried": stats.retried, "by_status": dict(stats.by_status)}}


class EndpointAnswerError(RuntimeError):
    """The endpoint answered a request the probe showed it supports with an error."""


def expect_ok(reply: Reply, what: str) -> Any:
    if not reply.ok:
        raise EndpointAnswerError(f"{what} failed: {reply.error_message()}")
    return reply.body


def open_session(url: str, *, vocab: Vocabulary, probe_prompt: list[int], eos_token: int, dtype: str,
                 model: str | None = None, api_key: str | None = None, limits: Limits | None = None,
                 note: str = "", transport: httpx.BaseTransport | None = None,
                 accepted: Sequence[Assignment] = (), excuse_roundings: bool = False) -> EndpointSession:
    """Connect, identify the server and the model, probe its features (SetupError if it cannot be verified)."""
    if dtype not in PRECISIONS:
        raise ValueError(f"declared precision must be one of {', '.join(PRECISIONS)}; got {dtype!r}")
    client = EndpointClient(url, api_key=api_key, limits=limits, transport=transport)
    try:
        name, identity = identify(client, model)
        resolver = TokenResolver(vocab)
        caps = probe(client, name, probe_prompt, eos_token, resolver)
    except BaseException:
        client.close()
        raise
    return EndpointSession(url, client, name, PRECISIONS[dtype], caps, identity, resolver, vocab, note,
                           list(accepted), excuse_roundings)


def accepted_record(a: Assignment) -> dict[str, Any]:
    """An accepted deviation as the report lists it: what, the released value, who is known to use it."""
    alt = a.alternative
    return {"convention": a.convention.name, "value": a.value_text, "resolved": a.value, "site": a.convention.site,
            "released": a.convention.released, "used_by": list(alt.used_by) if alt is not None else []}
