"""Concurrent streaming clients for `bench --served`, run in a process of their own.

The clients live in a separate process so that their JSON parsing and event loop never take the GIL from
the engine thread or the server they measure. Input (stdin, JSON): url, model, concurrency, new_tokens, and
`waves`: a list of prompt lists; client i sends waves[r][i] as its r-th request (token-id prompts, greedy,
ignore_eos, stream); optional `start_at`, a time.perf_counter() value to sleep until (several client processes
starting together). Output (stdout, JSON): one record per request with its text, the time to its first
token and the arrival time of every token chunk, plus the wall time of the whole run (from after the connections'
warm-up: see warm_connections).

    echo '{"url": ..., "model": ..., "new_tokens": 64, "waves": [[[1, 2, 3]]]}' | python -m k3verify.bench.clients
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx


async def stream_one(client: httpx.AsyncClient, model: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One streaming completion -> {text, start, chunk_times, error}; times on time.perf_counter()."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    text: list[str] = []
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"text": "", "start": start, "chunk_times": [], "error": f"{r.status_code}: {await r.aread()!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                return {"text": "".join(text), "start": start, "chunk_times": times, "error": str(payload["error"])}
            piece = "".join(c.get("text") or "" for c in payload.get("choices", []))
            if piece:
                times.append(time.perf_counter())
                text.append(piece)
    return {"text": "".join(text), "start": start, "chunk_times": times, "error": None}


async def client_loop(client: httpx.AsyncClient, model: str, prompts: list[list[int]], new_tokens: int,
                      out: list[dict[str, Any]]) -> None:
    for prompt in prompts:
        out.append(await stream_one(client, model, prompt, new_tokens))


async def warm_connections(client: httpx.AsyncClient, n: int) -> None:
    """n concurrent GET /v1/models (answered by the API process alone): the pool opens the connections the n clients
    will stream over and httpx finishes its lazy set-up, before any timed request. Without it each client process's
    first request pays that set-up inside its TTFT, several times the TTFT of the requests after it."""
    answers = await asyncio.gather(*(client.get("/v1/models") for _ in range(n)))
    bad = sorted({r.status_code for r in answers} - {200})
    if bad:
        raise RuntimeError(f"the clients' warm-up GET /v1/models answered {bad}: {answers[0].text[:200]}")


async def prompt_tokens_accepted(client: httpx.AsyncClient) -> float:
    """The server's count of prompt tokens its engine accepted (k3v_prompt_tokens_total on /metrics)."""
    text = (await client.get("/metrics")).text
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("k3v_prompt_tokens_total")), 0.0)


async def run_clients(url: str, model: str, waves: list[list[list[int]]], new_tokens: int,
                      timeout_s: float = 300.0, ordered: bool = False, start_at: float | None = None
                      ) -> dict[str, Any]:
    """len(waves[0]) clients; client i sends waves[0][i], then waves[1][i], ... back to back, over connections
    opened and warmed before the first request (then, with `start_at`, a sleep until that perf_counter() time).
    `ordered` (one wave): client i starts only once the engine accepted client i-1's prompt, so submissions
    follow the prompts' order (a held engine then admits them in that order)."""
    n = len(waves[0])
    if any(len(w) != n for w in waves):
        raise ValueError(f"every wave needs one prompt per client ({n}); got {[len(w) for w in waves]}")
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    records: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        await warm_connections(client, n)
        if start_at is not None:  # several client processes start together (perf_counter: system-wide monotonic)
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        start = time.perf_counter()
        tasks = []
        accepted = await prompt_tokens_accepted(client) if ordered else 0.0
        for i in range(n):
            tasks.append(asyncio.create_task(client_loop(client, model, [w[i] for w in waves], new_tokens,
                                                         records[i])))
            if ordered:
                accepted += len(waves[0][i])
                while await prompt_tokens_accepted(client) < accepted:
                    await asyncio.sleep(0.002)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
        wall = time.perf_counter() - start
    return {"wall_s": wall, "requests": [r for per_client in records for r in per_client],
            "order": [[i, r] for i in range(n) for r in range(len(waves))]}


def main() -> int:
    spec = json.load(sys.stdin)
    result = asyncio.run(run_clients(spec["url"], spec["model"], spec["waves"], spec["new_tokens"],
                                     spec.get("timeout_s", 300.0), spec.get("ordered", False), spec.get("start_at")))
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
