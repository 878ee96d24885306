"""HTTP limits enforced while reading (body size, JSON depth), token ids checked against the vocabulary, an empty
API key refused, and the poison requests of issue 15 answered without harm to the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import torch
from server_harness import TINY, RecordingRunner, RunningServer, make_tiny_runner, running_server, tiny_parts
from starlette.requests import Request
from test_server_errors import assert_envelope

from k3verify.api.app import create_app
from k3verify.api.body import MAX_BODY_BYTES, MAX_JSON_DEPTH, json_depth, read_body
from k3verify.api.errors import APIError

GOOD = {"model": TINY, "prompt": "hi", "max_tokens": 4}
JSON = {"content-type": "application/json"}
MiB = 1 << 20


def endless_request(headers: list[tuple[bytes, bytes]]) -> tuple[Request, list[int]]:
    """A Request whose body never ends (1 MiB per receive); the list counts the chunks the server pulled."""
    pulled = [0]

    async def receive() -> dict[str, Any]:
        pulled[0] += 1
        return {"type": "http.request", "body": b" " * MiB, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    return Request(scope, receive), pulled


def test_body_limit_stops_reading_at_the_limit() -> None:
    """A chunked body without Content-Length is refused with 413 after at most limit + one chunk, not read whole."""
    request, pulled = endless_request([])
    with pytest.raises(APIError) as info:
        asyncio.run(read_body(request))
    assert info.value.status == 413 and pulled[0] == MAX_BODY_BYTES // MiB + 1


def test_declared_oversized_body_is_refused_unread() -> None:
    """A Content-Length over the limit is a 413 before a single body byte is read."""
    request, pulled = endless_request([(b"content-length", str(MAX_BODY_BYTES + 1).encode())])
    with pytest.raises(APIError) as info:
        asyncio.run(read_body(request))
    assert info.value.status == 413 and pulled[0] == 0


def test_json_depth_ignores_brackets_inside_strings() -> None:
    """Depth counts structure only: brackets in string values (escaped quotes included) do not nest."""
    assert json_depth(b'{"a": [[1], {"b": [2]}]}') == 4
    text = b'{"prompt": "' + b'[{' * 100 + b'\\"]' + b'", "x": [[[]]]}'
    assert json_depth(text) == 4
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_json_is_400_not_500(tiny_server: RunningServer, depth: int) -> None:
    """The 100k-bracket body of issue 15 (and one level past the limit) is a 400 naming the limit."""
    body = b'{"model": "k3-tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=body, timeout=30, headers=JSON)
    assert_envelope(r, 400, contains=f"the limit is {MAX_JSON_DEPTH}")


def test_brackets_in_a_prompt_string_are_just_text(tiny_server: RunningServer) -> None:
    """A prompt full of brackets is served: the depth check is not fooled by string contents."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD | {"prompt": "[{" * 200}, timeout=60)
    assert r.status_code == 200, r.text


def test_lone_surrogate_is_400_and_a_surrogate_pair_is_text(tiny_server: RunningServer) -> None:
    """A \\ud800 escape with no partner is not text (400, before any tokenizer sees it); an escaped pair is an emoji."""
    url = f"{tiny_server.url}/v1/completions"
    body = b'{"model": "k3-tiny", "max_tokens": 2, "prompt": "x\\ud800"}'
    assert_envelope(httpx.post(url, content=body, timeout=10, headers=JSON), 400, contains="lone UTF-16 surrogate")
    pair = body.replace(b"\\ud800", b"\\ud83d\\ude00")
    assert httpx.post(url, content=pair, timeout=60, headers=JSON).status_code == 200


@pytest.mark.parametrize(("ids", "contains"), [
    ([-1], "greater than or equal to 0"), ([4608], "stop_token_ids must name token ids in [0, 4608)"),
    ([2**40], "less than 2147483648"), (list(range(65)), "at most 64"), (["7"], "valid integer"),
])
def test_stop_token_ids_are_checked_against_the_vocabulary(tiny_server: RunningServer, ids: list[Any],
                                                           contains: str) -> None:
    """Negative, out-of-vocabulary, huge, too many or non-integer stop ids are 400s naming stop_token_ids."""
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=GOOD | {"stop_token_ids": ids}, timeout=10)
    assert str(assert_envelope(r, 400, contains=contains)["param"]).startswith("stop_token_ids")


@pytest.mark.parametrize(("change", "param"), [
    ({"top_k": 2**21}, "top_k"), ({"max_tokens": 2**40}, "max_tokens"), ({"temperature": 1e308 * 10}, None),
])
def test_numeric_limits_are_400(tiny_server: RunningServer, change: dict[str, Any], param: str | None) -> None:
    """Values past the sampler's limits (and JSON's: 1e309 is Infinity) are 400, never reach the engine."""
    body = (b'{"model": "k3-tiny", "prompt": "x", "temperature": 1e309}' if param is None
            else httpx.Request("POST", "/", json=GOOD | change).content)
    r = httpx.post(f"{tiny_server.url}/v1/completions", content=body, timeout=10, headers=JSON)
    assert_envelope(r, 400, param=param)


@pytest.mark.parametrize("temperature", [1e-30, 5e-324, 1e-7])
def test_tiny_temperature_poison_request_is_served(tiny_server: RunningServer, temperature: float) -> None:
    """The request that used to end the engine: a positive temperature far below 1e-6 is a 200 (greedy-like) and
    the engine stays ok."""
    body = GOOD | {"temperature": temperature, "top_p": 0.5, "max_tokens": 3}
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    greedy = httpx.post(f"{tiny_server.url}/v1/completions", json=body | {"temperature": 0}, timeout=60)
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert httpx.get(f"{tiny_server.url}/health", timeout=5).json()["status"] == "ok"


def test_empty_api_key_is_refused_at_startup() -> None:
    """create_app refuses "" (it would let an empty bearer token in) and a key with whitespace at an end (no bearer
    token can carry it: every client, the exact key included, would be refused); None means no authentication."""
    with pytest.raises(ValueError, match="non-empty"):
        create_app(object(), tiny_parts()[2], model_name=TINY, api_key="")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        create_app(object(), tiny_parts()[2], model_name=TINY, api_key="  ")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="whitespace at its start or end"):
        create_app(object(), tiny_parts()[2], model_name=TINY, api_key="abc12345 ")  # type: ignore[arg-type]


def test_a_key_presented_with_padding_is_the_configured_key() -> None:
    """`Authorization: bearer  abc12345` (padded) is the key abc12345: presented tokens are trimmed, and a configured
    key cannot hold padding, so both sides agree (httpx will not even send a value ending in whitespace)."""
    with running_server(api_key="abc12345") as server:
        url = f"{server.url}/v1/completions"
        for header in ("Bearer abc12345", "bearer  abc12345"):
            assert httpx.post(url, json=GOOD, headers={"Authorization": header}, timeout=60).status_code == 200
        assert httpx.post(url, json=GOOD, headers={"Authorization": "Bearer abc1234"}, timeout=10).status_code == 401


class PoisonRunner(RecordingRunner):
    """The k3-tiny runner whose next decode answers NaN for its first row."""

    poison_next = False

    def decode_next(self, seq_ids: list[int], graphs: object = None) -> torch.Tensor:
        logits = super().decode_next(seq_ids, graphs)
        if self.poison_next:
            self.poison_next = False
            logits = logits.clone()
            logits[0] = float("nan")
        return logits


def test_nonfinite_logits_are_500_with_reason_and_metric_health_degraded() -> None:
    """NaN logits fail that request (500, code nonfinite_logits); /metrics counts it; /health stays 200 but
    degraded; past --nonfinite-threshold it turns 503."""
    from k3verify.serving.health import HealthPolicy

    runner = PoisonRunner(make_tiny_runner())
    with running_server(runner, health_policy=HealthPolicy(max_nonfinite=2)) as server:
        for expected_health in (200, 503):
            runner.poison_next = True
            r = httpx.post(f"{server.url}/v1/completions", json=GOOD | {"ignore_eos": True}, timeout=60)
            err = assert_envelope(r, 500, contains="non-finite logits")
            assert err["code"] == "nonfinite_logits"
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == expected_health
        assert "k3v_nonfinite_logits_total 2.0" in httpx.get(f"{server.url}/metrics", timeout=5).text
        assert httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=60).status_code == 200
