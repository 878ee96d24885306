"""The real k3-tiny server through the official `openai` client: completions, chat, streaming, stops, seeds,
logprobs, models, metrics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from server_harness import (
    TINY,
    RecordingRunner,
    RunningServer,
    greedy_text,
    make_tiny_runner,
    offline_greedy,
    running_server,
    tiny_parts,
)

from k3verify.tokenizer import encode_chat

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]


def encode(text: str) -> list[int]:
    return tiny_parts()[2].encode(text)


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    return greedy_text(offline_greedy([prompt_ids], max_tokens)[0][0])


def test_completion_greedy_text_and_usage(client: openai.OpenAI) -> None:
    """A greedy completion returns exactly the offline greedy text, with prompt/completion token counts."""
    r = client.completions.create(model=TINY, prompt="hello world", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == expected_text(encode("hello world"), 12)
    assert r.usage is not None and r.usage.prompt_tokens == len(encode("hello world"))
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_accepts_token_id_prompt(client: openai.OpenAI) -> None:
    """A prompt given as token ids is served as those ids (no re-tokenization)."""
    ids = [5, 2000, 17, 999, 3]
    r = client.completions.create(model=TINY, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == expected_text(ids, 6)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_chat_uses_the_chat_template(client: openai.OpenAI) -> None:
    """Chat prompts are encode_chat's ids: usage and the greedy reply both follow from them."""
    r = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=10, temperature=0)
    ids = encode_chat(tiny_parts()[2], MESSAGES)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(ids, 10)
    assert r.usage.prompt_tokens == len(ids)


def test_chat_stream_with_usage_matches_non_stream(client: openai.OpenAI) -> None:
    """Streamed deltas concatenate to the non-streamed reply; include_usage adds one final usage chunk."""
    full = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_ends_with_done(tiny_server: RunningServer) -> None:
    """Raw SSE: every event is `data: {json}`, no usage unless asked, and the stream ends `data: [DONE]`."""
    body = {"model": TINY, "prompt": "abc", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all("usage" not in p and len(p["choices"]) == 1 for p in payloads)
    assert "".join(p["choices"][0]["text"] for p in payloads) == expected_text(encode("abc"), 5)


def test_stop_string_truncates_before_stop(client: openai.OpenAI) -> None:
    """Output ends right before the first occurrence of a stop string, streamed or not, finish_reason stop."""
    ids = encode("stop test")
    full = greedy_text(offline_greedy([ids], 40)[0][0])
    start = next(i for i in range(6, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].isalnum())
    stop = full[start:start + 2]
    expected = full[: full.index(stop)]
    r = client.completions.create(model=TINY, prompt="stop test", max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=TINY, prompt="stop test", max_tokens=40, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_generation(client: openai.OpenAI) -> None:
    """A stop_token_ids entry ends generation at its first occurrence and adds no text."""
    ids = encode("tokens")
    greedy = offline_greedy([ids], 20)[0][0]
    stop_tok = greedy[6]
    cut = greedy[: greedy.index(stop_tok)]
    r = client.completions.create(model=TINY, prompt="tokens", max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [stop_tok], "ignore_eos": True})
    assert r.choices[0].text == greedy_text(cut) and r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == len(cut) + 1


def _sampled(client: openai.OpenAI, seed: int, prompt: str = "seeded") -> str:
    r = client.completions.create(model=TINY, prompt=prompt, max_tokens=20, temperature=1.0, top_p=0.9,
                                  seed=seed, extra_body={"top_k": 40, "ignore_eos": True})
    return r.choices[0].text


def test_seeded_sampling_reproducible_with_other_batch_neighbours(client: openai.OpenAI,
                                                                  tiny_server: RunningServer) -> None:
    """Same seed → same text, alone or amid concurrent differently-seeded requests; another seed → other text."""
    alone = _sampled(client, seed=1234)
    before = len(tiny_server.runner.decode_sizes)
    with ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(_sampled, client, seed=i, prompt=f"neighbour {i}") for i in range(5)]
        crowded = [pool.submit(_sampled, client, seed=1234) for _ in range(2)]
        results = [f.result() for f in crowded]
        [f.result() for f in noise]
    assert results == [alone, alone]
    assert _sampled(client, seed=4321) != alone
    assert max(tiny_server.runner.decode_sizes[before:]) > 1, "the requests never shared a batch: proves nothing"


def test_completion_logprobs_shape_and_values(client: openai.OpenAI) -> None:
    """logprobs=k: one entry per generated token, k alternatives each, values = the model's log_softmax."""
    r = client.completions.create(model=TINY, prompt="lp", max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and r.usage is not None
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n == 8
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    runner = make_tiny_runner()
    runner.admit(0, 10)
    first = torch.log_softmax(runner.prefill([(0, encode("lp"))])[0].float(), -1)
    assert lp.token_logprobs[0] == pytest.approx(float(first.max()), abs=1e-4)
    assert max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0], abs=1e-6)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_top_logprobs_shape(client: openai.OpenAI) -> None:
    """Chat logprobs: one entry per token, exactly top_logprobs alternatives, sorted, bytes that spell the token."""
    r = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=6, temperature=0.8, seed=7,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0.0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= -9999.0
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_models_lists_the_served_model(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    """GET /v1/models names exactly the served model and its context length."""
    models = httpx.get(f"{tiny_server.url}/v1/models", timeout=10).json()
    assert [m.id for m in client.models.list().data] == [TINY]
    assert models["data"][0]["max_model_len"] == tiny_server.runner.max_context


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[-1])


def test_metrics_count_requests_tokens_and_latency(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    """/metrics: request counts by status, exact token counters, load gauges, latency histograms."""
    url = tiny_server.url
    before = {n: _metric(url, n) for n in ("k3v_prompt_tokens_total", "k3v_generation_tokens_total",
                                           "k3v_time_to_first_token_seconds_count")}
    r = client.completions.create(model=TINY, prompt="m", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TINY, prompt="m", max_tokens=-3)
    assert _metric(url, "k3v_prompt_tokens_total") - before["k3v_prompt_tokens_total"] == r.usage.prompt_tokens
    assert _metric(url, "k3v_generation_tokens_total") - before["k3v_generation_tokens_total"] == 3
    assert _metric(url, "k3v_time_to_first_token_seconds_count") - before["k3v_time_to_first_token_seconds_count"] == 1
    assert _metric(url, "k3v_inter_token_latency_seconds_count") >= 2
    assert _metric(url, "k3v_queue_depth") == 0 and _metric(url, "k3v_running_batch_size") == 0
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'k3v_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'k3v_requests_total{endpoint="/v1/completions",status="400"}' in text


def test_chat_without_max_tokens_fits_the_cache() -> None:
    """No max_tokens: the reply may use what fits in an empty cache (here 128 tokens), capped by the default."""
    runner = RecordingRunner(make_tiny_runner(num_pages=9, page_size=16))
    with running_server(runner) as server:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=TINY, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 128 and r.choices[0].finish_reason == "length"
    with running_server(default_max_tokens=5) as server:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=TINY, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
