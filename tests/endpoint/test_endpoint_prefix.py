"""endpoint.prefix.reuse: a server whose answers change once a prompt's first block was seen before (as a prefix
cache restoring the wrong state answers) fails, naming the prompt, the request and the position; our own server
passes it (test_endpoint_parity.py runs every endpoint check against it) and reports its cache in usage and on
/metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from endpoint_fakes import proxy_app
from test_endpoint_parity import by_id, parity, served

from k3verify.api.thread import ServerThread
from k3verify.gates.checks.endpoint.prefix import BLOCK

SEEN_BLOCKS: set[tuple[int, ...]] = set()
AT = 2  # the answer position the fake cache gets wrong


def runner_up_after_a_cached_block(path: str, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A proxy that, like a cache restoring a state from the wrong position, answers the runner-up at position
    AT for every prompt whose first block an earlier request already sent."""
    prompt = tuple(body.get("prompt") or ())
    if path != "v1/completions" or len(prompt) < BLOCK:
        return answer
    block = prompt[:BLOCK]
    if block in SEEN_BLOCKS:
        logprobs = answer["choices"][0].get("logprobs") or {}
        tokens, top = logprobs.get("tokens") or [], logprobs.get("top_logprobs") or []
        if len(tokens) > AT and len(top) > AT:
            tokens[AT] = next(t for t in top[AT] if t != tokens[AT])
    SEEN_BLOCKS.add(block)
    return answer


def test_a_prefix_served_from_a_wrong_cached_state_fails_naming_prompt_and_position(tmp_path: Path) -> None:
    """Every hit on the shared block answers the runner-up at position 2: the check fails, its control fails, and
    the notes name the first hit (prefix+b, request 2) at position 2 against the oracle and each repeat against
    its first answer."""
    SEEN_BLOCKS.clear()
    with served() as url, ServerThread(proxy_app(url, perturb=runner_up_after_a_cached_block)) as proxy:
        code, data = parity(tmp_path, "--endpoint", proxy.url, "--only", "endpoint.prefix.reuse")
    result = by_id(data)["endpoint.prefix.reuse"]
    assert code == 1 and result["status"] == "fail" and result["control"]["status"] == "fail"
    notes = result["notes"]
    assert any(n.startswith("request 2 (alone): prompt prefix+b (117 tokens, 108 shared") and f"position {AT}:" in n
               and "oracle's greedy token" in n for n in notes), notes
    assert any(n.startswith("request 6 (alone): prompt prefix+a") and f"at position {AT} where its first answer" in n
               for n in notes), notes
    assert not any(n.startswith(("request 1 ", "request 3 ", "request 7 ")) for n in notes), notes  # short prompts


def test_usage_reports_cached_tokens_and_metrics_count_the_hit() -> None:
    """Our server (prefix cache on by default): a prompt sent twice reports 0 cached prompt tokens, then all of
    them (a whole-prompt hit); /metrics counts one hit, one miss and the reused tokens."""
    prompt = list(range(100, 100 + BLOCK + 6))
    body = {"model": "k3-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with served() as url:
        answers = [httpx.post(f"{url}/v1/completions", json=body, timeout=120).json() for _ in range(2)]
        metrics = httpx.get(f"{url}/metrics", timeout=60).text
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached == [0, len(prompt)] and answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert "k3v_prefix_cache_hits_total 1.0" in metrics, metrics
    assert f"k3v_prefix_cache_tokens_reused_total {float(len(prompt))}" in metrics, metrics
    assert 'k3v_prefix_cache_misses_total{reason="no_match"} 1.0' in metrics, metrics
