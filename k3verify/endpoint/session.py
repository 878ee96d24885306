"""One endpoint under test: client, model, the precision it declares, what it offers, who it is.

`open_session` lists the models, picks one, and probes the optional features; the checks (gates/checks/
endpoint_*.py) then only ask the session to build request bodies and parse answers by token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from k3verify.endpoint.client import EndpointClient, Limits, Reply
from k3verify.endpoint.probe import Capabilities, ServerIdentity, identify, probe
from k3verify.endpoint.wire import Answer, TokenResolver, Vocabulary, parse_chat, parse_completion, parse_stream

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class EndpointSession:
    url: str
    client: EndpointClient
    model: str
    dtype: torch.dtype  # the precision the endpoint declares (--dtype); the bars are taken at it
    caps: Capabilities
    identity: ServerIdentity
    resolver: TokenResolver
    note: str = ""

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
        return parse_completion(self.resolver, expect_ok(reply, "completion"), echo_len=echo_len)

    def complete_streamed(self, prompt: Sequence[int], **fields: Any) -> Answer:
        reply, events = self.client.stream("/v1/completions", self.completion_body(prompt, stream=True, **fields))
        expect_ok(reply, "streamed completion")
        return parse_stream(self.resolver, events, chat=False)

    def chat(self, messages: list[dict[str, Any]], **fields: Any) -> Answer:
        reply = self.client.post("/v1/chat/completions", {"model": self.model, "messages": messages, **fields})
        return parse_chat(self.resolver, expect_ok(reply, "chat completion"))

    def record(self) -> dict[str, Any]:
        """What report.json["run"]["endpoint"] says about this endpoint and the traffic sent to it."""
        stats = self.client.stats
        return {"url": self.url, "model": self.model, "declared_dtype": str(self.dtype).removeprefix("torch."),
                "server": {"models": self.identity.models, "headers": self.identity.headers},
                "capabilities": self.caps.as_dict(), "note": self.note,
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
                 note: str = "", transport: httpx.BaseTransport | None = None) -> EndpointSession:
    """Connect, identify the server and the model, probe its features (SetupError if it cannot be verified)."""
    if dtype not in DTYPES:
        raise ValueError(f"declared dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    client = EndpointClient(url, api_key=api_key, limits=limits, transport=transport)
    try:
        name, identity = identify(client, model)
        resolver = TokenResolver(vocab)
        caps = probe(client, name, probe_prompt, eos_token, resolver)
    except BaseException:
        client.close()
        raise
    return EndpointSession(url, client, name, DTYPES[dtype], caps, identity, resolver, note)
