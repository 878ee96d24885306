"""Greedy decoding through the server equals offline greedy generation, whatever shares the batch."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
from server_fakes import MODEL_VOCAB, TOKENIZER_VOCAB, FakeRunner, fake_generate_greedy, running_server

MAX_NEW = 24
PROMPT_LENGTHS = [1, 3, 17, 40, 64, 5, 90, 2]


def greedy_request(url: str, prompt: list[int]) -> dict:
    body = {"model": "toy", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def noise_request(url: str, rng: random.Random) -> int:
    body = {"model": "toy", "prompt": [rng.randrange(TOKENIZER_VOCAB) for _ in range(rng.randrange(1, 120))],
            "max_tokens": rng.randrange(1, 40), "temperature": 1.0, "top_p": 0.8, "stream": rng.random() < 0.5}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code


def test_greedy_through_server_equals_offline_under_concurrency() -> None:
    """8 greedy prompts sent concurrently with 16 random sampled requests return the offline greedy tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(TOKENIZER_VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    expected = fake_generate_greedy(prompts, MAX_NEW)
    runner = FakeRunner(max_slots=12, num_pages=256)
    with running_server(runner, max_prefill_tokens=256) as server:
        token_str = lambda t: server.engine.token_text.token_bytes(t).decode("utf-8", errors="replace")  # noqa: E731
        with ThreadPoolExecutor(24) as pool:
            noise = [pool.submit(noise_request, server.url, random.Random(i)) for i in range(16)]
            greedy = [pool.submit(greedy_request, server.url, p) for p in prompts]
            answers = [f.result() for f in greedy]
            assert [f.result() for f in noise] == [200] * 16
    for prompt, want, answer in zip(prompts, expected, answers, strict=True):
        got = answer["choices"][0]["logprobs"]["tokens"]
        assert got == [token_str(t) for t in want], f"prompt of {len(prompt)} tokens diverged"
        assert answer["usage"]["completion_tokens"] == MAX_NEW
    assert runner.max_batch_seen > 1 and max(runner.prefill_calls) > 1, "nothing was batched: proves nothing"
    assert MODEL_VOCAB > TOKENIZER_VOCAB
