"""Every client error is a 4xx in the OpenAI envelope naming the problem; none is a 5xx."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_harness import TINY, RunningServer, running_server, tiny_parts

GOOD = {"model": TINY, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_envelope(r: httpx.Response, status: int, *, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    assert contains.lower() in body["error"]["message"].lower(), body
    return body["error"]


INVALID_COMPLETIONS = [
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": "8"}, "max_tokens", "valid integer"),
    ({"max_tokens": 2.5}, "max_tokens", "integer"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"echo": True, "stream": True}, "echo", "not supported with stream"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ({"seed": "x"}, "seed", "valid integer"),
    ({"seed": 2**70}, "seed", "less than or equal to"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": 5}, "stop", ""),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias", "must be token ids"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {"99999": 1.0}}, "logit_bias", "must be in [0, 4608)"),
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
    ({"prompt": ""}, "prompt", "at least one token"),
    ({"prompt": [1, 2, 99999]}, "prompt", "token ids must be in [0, 4608)"),
    ({"prompt": [-1]}, "prompt", "token ids must be in"),
    ({"prompt": None}, "prompt", ""),
    ({"prompt": {"text": "x"}}, "prompt", ""),
    ({"frobnicate": 1}, "frobnicate", "unrecognized request argument"),
    ({"model": 5}, "model", "valid string"),
]


@pytest.mark.parametrize(("change", "param", "contains"), INVALID_COMPLETIONS,
                         ids=[f"{next(iter(c))}={next(iter(c.values()))!r}"[:40] for c, _, _ in INVALID_COMPLETIONS])
def test_invalid_completion_field_is_400_naming_it(tiny_server: RunningServer, change: dict, param: str,
                                                   contains: str) -> None:
    """Each invalid completions field → 400 invalid_request_error with param set and a message saying why."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD | change, timeout=10)
    err = assert_envelope(r, 400, param=param, contains=contains)
    assert err["type"] == "invalid_request_error"


INVALID_CHAT = [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", ""),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "missing"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content", "content is of type int; it must be a "
                                                                         "string, or a list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": "x"}]}]},
     "messages.0.content.1", "content part 1 has type 'image_url'; only 'text' parts are accepted"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages.0.content.0",
     'content part 0 is of type str, not an object; content must be a string, or a list of text parts {"type": '
     '"text"'),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs=true"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "less than or equal to 20"),
    ({"max_completion_tokens": -5}, "max_completion_tokens", "greater than or equal to 1"),
    ({"tool_choice": "required"}, "tool_choice", "not supported"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "missing"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls", "only assistant"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content", "missing"),
]


@pytest.mark.parametrize(("change", "param", "contains"), INVALID_CHAT,
                         ids=[next(iter(c)) + str(i) for i, (c, _, _) in enumerate(INVALID_CHAT)])
def test_invalid_chat_field_is_400_naming_it(tiny_server: RunningServer, change: dict, param: str,
                                             contains: str) -> None:
    """Each invalid chat field → 400 with param naming the (nested) field."""
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=CHAT | change, timeout=10)
    assert_envelope(r, 400, param=param, contains=contains)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b'"text"', b'{"model": "toy", "prompt": NaN}',
                                 b"\xff\xfe"], ids=["broken", "empty", "array", "string", "nan", "binary"])
def test_malformed_body_is_400(tiny_server: RunningServer, raw: bytes) -> None:
    """Bodies that are not a JSON object → 400, never 422/500."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=raw, timeout=10,
                   headers={"content-type": "application/json"})
    assert_envelope(r, 400)


def test_context_too_long_names_the_numbers(tiny_server: RunningServer) -> None:
    """prompt + max_tokens over the context → 400 context_length_exceeded naming prompt, max_tokens and the limit."""
    limit = tiny_server.runner.max_context
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD | {"prompt": [5] * 300, "max_tokens": limit},
                   timeout=10)
    err = assert_envelope(r, 400, param="prompt", contains=f"maximum context length is {limit} tokens")
    assert err["code"] == "context_length_exceeded"
    assert f"{limit + 300} tokens" in err["message"] and "300 in the prompt" in err["message"]
    assert f"{limit} for the completion" in err["message"]
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD | {"max_tokens": 2**20}, timeout=10)
    assert_envelope(r, 400, param="prompt", contains="maximum context length")
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD | {"max_tokens": 10**30}, timeout=10)
    assert_envelope(r, 400, param="max_tokens", contains="less than or equal to 1048576")


def test_chat_prompt_alone_over_context_is_400(tiny_server: RunningServer) -> None:
    """A chat whose prompt alone fills the context (no max_tokens) is a context-length 400, not a hang."""
    body = CHAT | {"messages": [{"role": "user", "content": " ".join(str(i) for i in range(3000))}]}
    body.pop("max_tokens")
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=10)
    assert_envelope(r, 400, param="messages", contains="maximum context length")


def test_unknown_model_is_404_model_not_found(tiny_server: RunningServer) -> None:
    """An unknown model → 404 with code model_not_found naming both models."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD | {"model": "gpt-9"}, timeout=10)
    err = assert_envelope(r, 404, param="model", contains="'gpt-9' does not exist")
    assert err["code"] == "model_not_found" and TINY in err["message"]


def test_unknown_route_and_method_use_envelope(tiny_server: RunningServer) -> None:
    """FastAPI's own 404/405 leave in the envelope too."""
    assert_envelope(httpx.get(f"{tiny_server.url}/v1/nothing", timeout=10), 404, contains="not found")
    assert_envelope(httpx.get(f"{tiny_server.url}/v1/completions", timeout=10), 405, contains="method not allowed")


def test_oversized_body_is_413(tiny_server: RunningServer) -> None:
    """A body over the size limit is refused before parsing, naming its declared size and the limit."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=b" " * (9 << 20), timeout=30,
                   headers={"content-type": "application/json"})
    assert_envelope(r, 413, contains=f"the request body of {9 << 20} bytes exceeds the limit of {8 << 20} bytes")


def test_chunked_oversized_body_is_413_naming_the_limit_without_a_partial_count(tiny_server: RunningServer) -> None:
    """A chunked body past the limit: the 413 states the limit and that the body exceeded it, and no byte count
    (the server stopped reading: how long the body was is unknown)."""
    def chunks() -> Iterator[bytes]:
        for _ in range(9):
            yield b" " * (1 << 20)

    r = httpx.post(f"{tiny_server.url}/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    err = assert_envelope(r, 413, contains=f"the request body exceeds the limit of {8 << 20} bytes (it was sent in "
                                           "chunks without a Content-Length")
    assert not re.search(r"\d+ bytes exceeds", err["message"]) and "more than" not in err["message"], err


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                          "application/jsonp"])
def test_a_body_that_is_not_declared_json_is_415(tiny_server: RunningServer, content_type: str | None) -> None:
    """A POST whose Content-Type is not application/json (the kind a browser sends cross-origin without a
    preflight) is refused 415 in the envelope, naming what was sent, even when its bytes are valid JSON."""
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=json.dumps(GOOD).encode(), headers=headers, timeout=10)
    err = assert_envelope(r, 415, contains="request bodies must be JSON, sent as Content-Type: application/json")
    assert err["code"] == "unsupported_media_type"
    assert ("no Content-Type" if content_type is None else repr(content_type)) in err["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
def test_json_with_or_without_a_charset_is_served(tiny_server: RunningServer, content_type: str) -> None:
    """application/json, bare or with charset=utf-8 (any case), is what a JSON API takes."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=json.dumps(GOOD).encode(),
                   headers={"content-type": content_type}, timeout=60)
    assert r.status_code == 200, r.text


def test_openai_client_sees_bad_request(tiny_server: RunningServer) -> None:
    """The official client raises BadRequestError carrying our message and param."""
    c = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=TINY, prompt="x", max_tokens=4, temperature=3.0)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert nf.value.code == "model_not_found"


def test_api_key_required_when_configured() -> None:
    """--api-key: /v1/* without the right bearer token → 401 envelope; with it → 200; /health stays open."""
    with running_server(api_key="s3cret") as server:
        url = f"{server.url}/v1/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            err = assert_envelope(httpx.post(url, json=GOOD, headers=headers, timeout=10), 401, contains="api key")
            assert err["code"] == "invalid_api_key"
        assert_envelope(httpx.get(f"{server.url}/v1/models", timeout=10), 401)
        ok = httpx.post(url, json=GOOD, headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


def test_no_client_error_is_5xx(tiny_server: RunningServer) -> None:
    """After all of the above, the metrics show no 5xx response from this server."""
    text = httpx.get(f"{tiny_server.url}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("k3v_requests_total{")]
    assert lines and not [ln for ln in lines if 'status="5' in ln], lines
    assert json.dumps(lines)  # keep the list in the failure message


def test_internal_error_is_500_envelope_and_counted() -> None:
    """A server bug still answers in the envelope and shows up as a 5xx in /metrics (so "no 5xx" checks can fail)."""
    class BrokenTokenizer:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def encode(self, text: str) -> list[int]:
            raise TypeError("tokenizer bug")

    with running_server(tokenizer=BrokenTokenizer(tiny_parts()[2])) as server:
        err = assert_envelope(httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=10), 500,
                              contains="tokenizer bug")
        assert err["type"] == "server_error"
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'k3v_requests_total{endpoint="/v1/completions",status="500"} 1.0' in text
