"""Conformance with vLLM's and SGLang's OpenAI servers, from recorded request/response fixtures written from
their documentation (fields, logprob shapes, error bodies): what the probe finds, how answers parse by token id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from k3verify.endpoint.client import Reply
from k3verify.endpoint.session import EndpointSession, open_session
from k3verify.tokenizer import default_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = [257, 298, 111, 660]  # "hello world" in the project's tokenizer
EOS = 4097


def _matches(want: Any, got: Any) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _matches(v, got[k]) for k, v in want.items())
    return bool(want == got)


def replay(name: str) -> tuple[httpx.MockTransport, list[dict[str, Any]]]:
    """A transport answering each request with the first recorded exchange it matches (method, path, and the
    `when` fields of its JSON body); the requests seen are collected."""
    exchanges = json.loads((FIXTURES / f"{name}.json").read_text())["exchanges"]
    seen: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        seen.append({"path": request.url.path, **body})
        for ex in exchanges:
            if ex["method"] == request.method and ex["path"] == request.url.path and _matches(ex.get("when", {}), body):
                if "sse" in ex:
                    text = "".join(f"data: {json.dumps(e)}\n\n" for e in ex["sse"]) + "data: [DONE]\n\n"
                    return httpx.Response(ex["status"], headers=ex["headers"], text=text)
                return httpx.Response(ex["status"], headers=ex["headers"], json=ex["body"])
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle), seen


def session(name: str) -> tuple[EndpointSession, list[dict[str, Any]]]:
    transport, seen = replay(name)
    ep = open_session("http://fixture:8000/v1", vocab=default_tokenizer(), probe_prompt=PROMPT, eos_token=EOS,
                      dtype="bfloat16", transport=transport)
    return ep, seen


def test_vllm_probe_finds_every_feature_and_records_the_server() -> None:
    """vLLM: token ids, echo prompt logprobs, logit_bias, chat, /tokenize with messages; owned_by vllm."""
    ep, seen = session("vllm")
    caps = ep.caps
    assert ep.model == "moonshotai/Kimi-Linear-48B-A3B-Instruct"
    assert all(f.available for f in (caps.completions, caps.token_ids, caps.echo_logprobs, caps.logit_bias,
                                     caps.chat, caps.tokenize, caps.tokenize_chat)), caps
    assert caps.tokenize_path == "/tokenize"
    record = ep.record()
    assert record["server"]["models"][0]["owned_by"] == "vllm" and record["server"]["headers"] == {"server": "uvicorn"}
    assert record["requests"]["sent"] == len(seen) <= 10


def test_vllm_echo_answer_parses_prompt_logprobs_by_token_id() -> None:
    """echo=true with token ids: the first prompt position is null, the rest resolve to the prompt's ids."""
    ep, _ = session("vllm")
    answer = ep.complete(PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert answer.prompt_steps is not None and [s.token_id for s in answer.prompt_steps] == PROMPT
    assert answer.prompt_steps[0].logprob is None and answer.prompt_steps[1].top == {298: -3.25, 262: -2.0}
    assert answer.token_ids == [422] and answer.steps[0].logprob == -0.125


def test_vllm_stream_joins_chunks_and_usage() -> None:
    """Streamed completion chunks join into the same text, ids and finish reason; the usage chunk is kept."""
    ep, seen = session("vllm")
    answer = ep.complete_streamed(PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                  stream_options={"include_usage": True})
    assert (answer.text, answer.token_ids, answer.finish_reason) == (" is a", [422, 262], "length")
    assert answer.usage == {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}
    assert seen[-1]["return_tokens_as_token_ids"] is True and seen[-1]["stream"] is True


def test_chat_logprobs_resolve_by_bytes_where_text_is_ambiguous() -> None:
    """Two byte tokens both decode to U+FFFD: their `bytes` tell them apart (text alone could not)."""
    ep, _ = session("vllm")
    answer = ep.chat([{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=2)
    assert answer.token_ids == [128, 129]
    assert answer.steps[0].top == {128: -0.5, 129: -1.5}
    assert ep.resolver.resolve("\ufffd") is None


def test_sglang_probe_reports_missing_features_with_the_servers_reason() -> None:
    """SGLang ignores return_tokens_as_token_ids (text tokens, resolved by text where unambiguous) and its
    /tokenize takes no messages: both recorded as unavailable with why; the rest is found."""
    ep, _ = session("sglang")
    caps = ep.caps
    assert not caps.token_ids.available and "came back as text" in caps.token_ids.reason
    assert caps.echo_logprobs.available and caps.logit_bias.available and caps.chat.available
    assert caps.tokenize.available and not caps.tokenize_chat.available
    assert "Field required" in caps.tokenize_chat.reason
    answer = ep.complete(PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert answer.prompt_steps is not None and [s.token_id for s in answer.prompt_steps] == PROMPT


@pytest.mark.parametrize(("body", "message"), [
    ({"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}},
     "404: The model `x` does not exist."),
    ({"object": "error", "message": "echo is not supported", "type": "BadRequestError", "param": None, "code": 400},
     "404: echo is not supported"),
    ({"detail": "Not Found"}, "404: Not Found"),
    ("<html>bad gateway</html>", "404: <html>bad gateway</html>"),
])
def test_error_bodies_of_every_server_family_are_read(body: Any, message: str) -> None:
    """OpenAI's envelope, vLLM/SGLang's flat error object, FastAPI's detail and a non-JSON body all give a message."""
    assert Reply(404, body, {}).error_message() == message
