"""Bounded load test for `k3verify serve`: N concurrent streaming clients, mixed prompt and output lengths,
some malformed requests and some clients that hang up mid-stream.

Asserts every well-formed request is answered completely, malformed ones get a 400, nothing gets a 5xx,
and the engine drains to idle with intact caches afterwards. Prints requests/s and p50/p99 latency.

    python tools/load_test.py                    # in-process k3-tiny server (no gate check), 64 clients
    python tools/load_test.py --url http://127.0.0.1:8000 --model k3-tiny --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx


def malformed_bodies(model: str) -> list[bytes | dict[str, Any]]:
    """Each must be answered 400: bad JSON, a missing model, and one invalid field each."""
    base = {"model": model, "prompt": "x"}
    return [b"{not json", {"prompt": "x"}, base | {"max_tokens": -4}, base | {"temperature": 9.0},
            base | {"n": 3}, base | {"top_p": "high"}, base | {"stop": ["a", "b", "c", "d", "e"]},
            base | {"max_tokens": 10**9}]


WORDS = "the cache holds latent pages while state slots carry the recurrence across decode steps".split()


@dataclass
class LoadResult:
    clients: int
    requests: int = 0
    completed: int = 0
    malformed: int = 0
    disconnected: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> str:
        lat, ttft = self.latencies, self.ttfts
        return (f"{self.clients} clients, {self.requests} requests ({self.completed} complete, {self.malformed} "
                f"malformed, {self.disconnected} disconnects) in {self.wall_s:.1f}s: {self.requests_per_s:.1f} "
                f"req/s, {self.tokens / self.wall_s:.0f} tok/s; latency p50 {self.percentile(lat, .5) * 1e3:.0f} ms "
                f"p99 {self.percentile(lat, .99) * 1e3:.0f} ms; TTFT p50 {self.percentile(ttft, .5) * 1e3:.0f} ms "
                f"p99 {self.percentile(ttft, .99) * 1e3:.0f} ms; failures {len(self.failures)}")


def well_formed(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 10, 40, 120])))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice([1, 4, 16, 32, 64]), "stream": True,
                            "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body |= {"temperature": rng.choice([0.5, 1.0]), "top_p": 0.9, "seed": rng.randrange(1 << 30)}
    if rng.random() < 0.15:
        body["stop"] = [rng.choice(["e", " the", "\n"])]
    if rng.random() < 0.5:
        return "/v1/completions", body | {"prompt": text}
    return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}


async def stream_one(client: httpx.AsyncClient, path: str, body: dict[str, Any], result: LoadResult,
                     hang_up_after: int | None) -> None:
    start = time.monotonic()
    first: float | None = None
    finish, usage, done, chunks = None, None, False, 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            result.failures.append(f"{path} {r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                result.failures.append(f"{path}: not an SSE data line: {line[:100]!r}")
                return
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                result.failures.append(f"{path}: error event {payload['error']}")
                return
            chunks += 1
            for choice in payload.get("choices", []):
                finish = choice.get("finish_reason") or finish
                if first is None and (choice.get("text") or (choice.get("delta") or {}).get("content") or finish):
                    first = time.monotonic()
            usage = payload.get("usage") or usage
            if hang_up_after is not None and chunks >= hang_up_after:
                result.disconnected += 1
                return  # leaving the context manager closes the connection mid-stream
    if not (done and finish in ("stop", "length") and usage):
        result.failures.append(f"{path}: incomplete stream (done={done}, finish={finish}, usage={usage})")
        return
    result.completed += 1
    result.tokens += usage["completion_tokens"]
    result.latencies.append(time.monotonic() - start)
    result.ttfts.append((first or time.monotonic()) - start)


async def client_loop(client: httpx.AsyncClient, rng: random.Random, model: str, n: int, result: LoadResult,
                      malformed_frac: float, disconnect_frac: float) -> None:
    for _ in range(n):
        result.requests += 1
        roll = rng.random()
        if roll < malformed_frac:
            bad = rng.choice(malformed_bodies(model))
            kwargs = {"content": bad, "headers": {"content-type": "application/json"}} if isinstance(bad, bytes) \
                else {"json": bad}
            r = await client.post("/v1/completions", **kwargs)
            result.malformed += 1
            if r.status_code != 400 or "error" not in r.json():
                result.failures.append(f"malformed {bad!r}: {r.status_code} {r.text[:200]}")
            continue
        path, body = well_formed(rng, model)
        hang_up = rng.choice([1, 2, 3]) if roll < malformed_frac + disconnect_frac else None
        if hang_up is not None:
            body["max_tokens"] = 64
        await stream_one(client, path, body, result, hang_up)


async def run_load(url: str, *, model: str, clients: int = 64, requests_per_client: int = 4, seed: int = 0,
                   malformed_frac: float = 0.1, disconnect_frac: float = 0.1, timeout_s: float = 120.0) -> LoadResult:
    """Drive `clients` concurrent clients, each sending `requests_per_client` requests; then wait for idle."""
    result = LoadResult(clients)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()
        loops = [client_loop(client, random.Random(seed * 1000 + i), model, requests_per_client, result,
                             malformed_frac, disconnect_frac) for i in range(clients)]
        await asyncio.wait_for(asyncio.gather(*loops), timeout_s)
        result.wall_s = time.monotonic() - start
        deadline = time.monotonic() + 30
        while True:
            health = await client.get("/health")
            body = health.json()
            if health.status_code != 200:
                result.failures.append(f"/health {health.status_code}: {body}")
                break
            if body["waiting"] == 0 and body["running"] == 0:
                break
            if time.monotonic() > deadline:
                result.failures.append(f"engine did not drain within 30 s: {body}")
                break
            await asyncio.sleep(0.05)
        metrics = (await client.get("/metrics")).text
    fives = [ln for ln in metrics.splitlines() if ln.startswith("k3v_requests_total{") and 'status="5' in ln]
    result.failures += [f"5xx recorded: {ln}" for ln in fives]
    return result


@contextmanager
def tiny_server(num_slots: int = 16, dtype: str = "float32") -> Iterator[tuple[str, Any]]:
    """An in-process k3-tiny server on 127.0.0.1 (synthetic weights; no gate check: this is a load tool)."""
    import torch

    from k3verify.api.app import create_app
    from k3verify.api.metrics import ServerMetrics
    from k3verify.api.thread import ServerThread
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.presets import get_preset
    from k3verify.serving.engine import Engine
    from k3verify.serving.runner import build_runner
    from k3verify.tokenizer import default_tokenizer

    cfg = get_preset("k3-tiny")
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=getattr(torch, dtype), device="cpu",
                          num_slots=num_slots)
    metrics = ServerMetrics()
    engine = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                    observer=metrics).start()
    app = create_app(engine, default_tokenizer(), model_name="k3-tiny", metrics=metrics)
    try:
        with ServerThread(app) as server:
            yield server.url, engine
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="an already running server (default: start k3-tiny in-process)")
    p.add_argument("--model", default="k3-tiny")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--num-slots", type=int, default=16, help="in-process server: sequence slots")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="in-process server dtype")
    args = p.parse_args(argv)

    def go(url: str) -> LoadResult:
        return asyncio.run(run_load(url, model=args.model, clients=args.clients, seed=args.seed,
                                    requests_per_client=args.requests_per_client, timeout_s=args.timeout))

    if args.url:
        result = go(args.url)
    else:
        with tiny_server(args.num_slots, args.dtype) as (url, engine):
            result = go(url)
            try:
                engine.check_integrity()
            except Exception as exc:
                result.failures.append(f"cache integrity after the run: {type(exc).__name__}: {exc}")
    print(result.summary())
    for failure in result.failures[:20]:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
