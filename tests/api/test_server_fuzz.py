"""Property-based fuzzing of /v1/completions and /v1/chat/completions (hypothesis, derandomized for CI): every
answer is a 2xx or a 4xx in the OpenAI error shape, streams are well-formed SSE ending in [DONE], and afterwards
the server is healthy with its caches intact. Thousands of requests go to a toy runner (fast, real page
bookkeeping); a few hundred to the real k3-tiny model and tokenizer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fakes import EOS, IM_END, MODEL_VOCAB, ByteTokenizer, FakeRunner
from server_harness import TINY, RecordingRunner, RunningServer, make_tiny_runner, running_server

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs", "echo",
          "ignore_eos", "presence_penalty", "frequency_penalty", "logit_bias", "user", "best_of", "suffix"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 12),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 1e-30, 5e-324, 1e-7, 2.0, 2.0000001, 1.0]),
    st.text(max_size=12), st.sampled_from(["", "k3-tiny", "toy", "\ud800", "<|im_end|>", "[EOS]"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)
odd_text = st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00", "\x00", "[EOS]<|im_end|>", "\u202e" * 3, "é" * 30])
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "user", "tool", "x"]),
     "content": st.one_of(st.text(max_size=20), odd_text, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=10)}), max_size=2), json_values)}),
    min_size=1, max_size=3)
prompts = st.one_of(st.text(max_size=24), odd_text, st.lists(st.integers(-5, 299), max_size=12),
                    st.lists(st.integers(0, 299), min_size=1, max_size=12), st.lists(st.text(max_size=8), max_size=2),
                    st.lists(st.lists(st.integers(0, 300), max_size=4), max_size=2))
valid = {
    "max_tokens": st.integers(1, 6), "max_completion_tokens": st.integers(1, 6), "temperature": st.one_of(
        st.floats(0, 2), st.sampled_from([0.0, 1e-30, 5e-324, 1e-7])), "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 60), "n": st.just(1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, MODEL_VOCAB - 1), max_size=4), "seed": st.integers(-(2**63), 2**64 - 1),
    "logprobs": st.one_of(st.integers(0, 20), st.booleans()), "top_logprobs": st.integers(0, 20),
    "ignore_eos": st.booleans(), "user": st.text(max_size=8), "presence_penalty": st.just(0.0),
    "frequency_penalty": st.just(0.0), "messages": messages, "prompt": prompts,
}


@st.composite
def bodies(draw: st.DrawFn, endpoint: str, model: str) -> bytes:
    """A request body: mostly near-valid JSON objects (some fields mutated), sometimes raw junk or deep nesting."""
    kind = draw(st.sampled_from(["object"] * 8 + ["raw", "deep"]))
    if kind == "raw":
        return draw(st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)))
    if kind == "deep":
        depth = draw(st.integers(20, 5000))
        return b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    body: dict[str, Any] = {"model": model, "max_tokens": 3, "stream": draw(st.booleans())}
    body["prompt" if endpoint == "completions" else "messages"] = (
        "hi" if endpoint == "completions" else [{"role": "user", "content": "hi"}])
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)):
        well_typed = draw(st.sampled_from([True] * 5 + [False])) and name in valid
        body[name] = draw(valid[name] if well_typed else json_values)
    if draw(st.sampled_from([False] * 7 + [True])):
        body[draw(st.text(max_size=8))] = draw(json_values)
    return json.dumps(body).encode()


def check_answer(r: httpx.Response, lines: list[str] | None) -> None:
    """2xx with a well-formed body or stream, or a 4xx OpenAI error envelope; never a 5xx."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
        return
    if lines is None:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        return
    events = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", lines[-3:]
    payloads = [json.loads(e) for e in events[:-1]]
    assert not [p for p in payloads if "error" in p], payloads
    finals = [c["finish_reason"] for p in payloads for c in p["choices"] if c.get("finish_reason")]
    assert finals and finals[-1] in ("stop", "length")


def send(client: httpx.Client, endpoint: str, body: bytes, seen: list[str]) -> None:
    headers = {"content-type": "application/json"}
    with client.stream("POST", f"/v1/{endpoint}", content=body, headers=headers) as r:
        streaming = r.headers.get("content-type", "").startswith("text/event-stream")
        lines = list(r.iter_lines()) if streaming else None
        if not streaming:
            r.read()
    check_answer(r, lines)
    seen.append(f"{r.status_code}{' stream' if streaming else ''}")


def assert_varied(seen: list[str]) -> None:
    """The generated requests reached both sides: plenty of 4xx, and completions both plain and streamed."""
    n = len(seen)
    assert sum(s.startswith("4") for s in seen) > n // 10, "almost nothing was refused: the fuzz is too tame"
    assert sum(s == "200" for s in seen) > n // 20 and sum(s == "200 stream" for s in seen) > n // 100, \
        "almost nothing was served: the fuzz never reached the engine"


def settle(server: RunningServer) -> None:
    """Health is ok and every cache is free once the aborts have been processed."""
    deadline = time.monotonic() + 10
    while server.engine.num_running or server.engine.num_waiting:
        assert time.monotonic() < deadline, "requests still running after the fuzz run"
        time.sleep(0.02)
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    server.engine.check_integrity()


def byte_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A toy chat encoder (api/state.py's ChatEncoder shape): the messages' repr as bytes, at most 64."""
    return [ord(c) % 256 for c in str(messages)][:64] or [1]


@pytest.fixture(scope="module")
def toy_server() -> Iterator[RunningServer]:
    runner = FakeRunner(max_context=256, num_pages=64, max_slots=8)
    with running_server(runner, model="toy", tokenizer=ByteTokenizer(), eos_ids=(EOS, IM_END),
                        vocab_size=MODEL_VOCAB, encode_chat=byte_chat,
                        debug=True) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_fuzz_server() -> Iterator[RunningServer]:
    with running_server(RecordingRunner(make_tiny_runner())) as server:
        yield server


FAST = settings(max_examples=1200, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
REAL = settings(FAST, max_examples=150)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_fuzz_toy_runner_never_5xx(toy_server: RunningServer, endpoint: str) -> None:
    """1,200 generated requests per endpoint against the toy runner: all 2xx/4xx; healthy and clean after."""
    with httpx.Client(base_url=toy_server.url, timeout=30) as client:
        seen: list[str] = []

        @FAST
        @given(body=bodies(endpoint.split("/")[0], "toy"))
        def run(body: bytes) -> None:
            send(client, endpoint, body, seen)

        run()
    assert_varied(seen)
    settle(toy_server)
    assert toy_server.runner.slots == {} and toy_server.runner.free_pages == toy_server.runner.num_pages


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_fuzz_real_model_never_5xx(tiny_fuzz_server: RunningServer, endpoint: str) -> None:
    """150 generated requests per endpoint against k3-tiny with its own tokenizer and chat template."""
    with httpx.Client(base_url=tiny_fuzz_server.url, timeout=60) as client:
        seen: list[str] = []

        @REAL
        @given(body=bodies(endpoint.split("/")[0], TINY))
        def run(body: bytes) -> None:
            send(client, endpoint, body, seen)

        run()
    assert_varied(seen)
    settle(tiny_fuzz_server)
    tiny_fuzz_server.runner.assert_empty()
