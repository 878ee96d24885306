"""Bounded chaos run of `k3verify serve` on loopback: the gate against a checkpoint changed after gating, then
concurrent clients mixing good requests, fuzz, poison requests and hang-ups, with one injected engine fault; then
`k3verify serve` itself (supervised) with kill -9 of its engine's process and of its HTTP front end under
streaming clients (tools/chaos_kill.py).

    python -m tools.chaos                      # k3-tiny copy, real quick parity gate, 400 requests, 32 clients
    python -m tools.chaos --requests 1000 --clients 64 --kill-clients 64

Prints: requests sent, 2xx, 4xx, 5xx (those at the injected fault apart), engine restarts, lost. A request is
"lost" when the server accepted it (HTTP 200) and it never got a final answer (a finish_reason or an error
event) without the client hanging up, or when its connection closed with no answer at all. Exit 0 iff lost == 0,
no 5xx outside the fault, exactly one restart, the tampered checkpoint was refused, the engine ends healthy with
clean caches, and both kills pass (chaos_kill.py: no client of the killed engine left without an answer, the
engine alive through the front end's death and the front end back within 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tools.load_test import malformed_bodies, well_formed

FAULT = "chaos: injected engine fault"
KINDS = ["good"] * 5 + ["fuzz"] * 2 + ["poison"] * 2 + ["hangup", "timeout"]


@dataclass
class Outcome:
    kind: str
    status: int | None = None  # HTTP status; None when no response arrived
    final: bool = False  # a finish_reason or an error event arrived
    error: str = ""
    hung_up: bool = False  # the client left on purpose


@dataclass
class Chaos:
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def fuzz_body(rng: random.Random, model: str) -> bytes | dict[str, Any]:
    junk: list[Any] = [None, True, -1, 0, 2**64, 1e308, -0.5, "", "x" * 50, [], {}, [[[]]], {"a": {"b": 1}}]
    field_names = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed",
                   "stream", "logprobs", "messages", "n", "frobnicate"]
    choice = rng.randrange(6)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
    if choice == 1:
        depth = rng.choice([40, 1000, 100_000])
        return b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if choice == 2:
        return b'{"model": "' + model.encode() + b'", "prompt": "\\ud800", "max_tokens": 2}'
    if choice == 3:
        return rng.choice(malformed_bodies(model))
    body = {"model": model, "prompt": "x", "max_tokens": 2}
    body[rng.choice(field_names)] = rng.choice(junk)
    return body


def poison_body(rng: random.Random, model: str) -> dict[str, Any]:
    """Valid requests at the edges of every sampling parameter: the kind that used to end the engine."""
    body: dict[str, Any] = {"model": model, "prompt": "poison", "max_tokens": rng.choice([1, 3, 8]),
                            "stream": rng.random() < 0.5, "ignore_eos": True}
    body |= rng.choice([{"temperature": 1e-30}, {"temperature": 5e-324, "top_p": 1e-9}, {"temperature": 2.0,
                        "top_k": 1 << 20}, {"top_k": 1, "seed": 2**64 - 1}, {"seed": -(2**63), "top_p": 1.0},
                        {"stop_token_ids": [0, 1, 2]}, {"logprobs": 20, "temperature": 1e-20},
                        {"prompt": [0] * 8}, {"stop": ["\n", "e", "the", " "]}])
    return body


async def stream_until_final(r: httpx.Response, out: Outcome, hang_up_after: int | None) -> None:
    chunks = 0
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        payload = json.loads(line[6:])
        if "error" in payload:
            out.final, out.error = True, str(payload["error"]["message"])
            return
        chunks += 1
        if any(c.get("finish_reason") for c in payload.get("choices", [])):
            out.final = True
        if hang_up_after is not None and chunks >= hang_up_after and not out.final:
            out.hung_up = True
            return


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str) -> Outcome:
    out = Outcome(rng.choice(KINDS))
    if out.kind == "good":
        path, body = well_formed(rng, model)
        body |= {"max_tokens": min(body["max_tokens"], 16), "stream": rng.random() < 0.7}
    elif out.kind == "hangup":
        path, body = "/v1/completions", {"model": model, "prompt": "bye", "max_tokens": 64, "stream": True,
                                         "ignore_eos": True}
    elif out.kind == "timeout":
        path, body = "/v1/completions", {"model": model, "prompt": "slow", "max_tokens": 64, "ignore_eos": True}
    else:
        path = "/v1/completions"
        raw = fuzz_body(rng, model) if out.kind == "fuzz" else poison_body(rng, model)
        body = raw if isinstance(raw, dict) else {"__raw__": raw}
    kwargs: dict[str, Any] = {"content": body["__raw__"], "headers": {"content-type": "application/json"}} \
        if "__raw__" in body else {"json": body}
    timeout = 0.05 if out.kind == "timeout" else 120.0
    try:
        async with client.stream("POST", path, timeout=timeout, **kwargs) as r:
            out.status = r.status_code
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                await stream_until_final(r, out, rng.choice([1, 2]) if out.kind == "hangup" else None)
            else:
                data = json.loads(await r.aread())
                out.final = "error" in data or bool(data.get("choices"))
                out.error = str(data.get("error", {}).get("message", "")) if "error" in data else ""
    except httpx.TimeoutException:
        out.hung_up = out.kind == "timeout"
        out.error = out.error or "client-side timeout"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def traffic(url: str, engine: Any, model: str, requests: int, clients: int, seed: int, chaos: Chaos) -> None:
    """`requests` requests from `clients` concurrent clients; the engine fault is injected halfway."""
    sent = 0
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        async def loop(i: int) -> None:
            nonlocal sent
            rng = random.Random(seed * 7919 + i)
            while sent < requests:
                sent += 1
                if sent == requests // 2:
                    engine.inject_fault(FAULT)
                chaos.outcomes.append(await one_request(client, rng, model))

        await asyncio.gather(*(loop(i) for i in range(clients)))


def gate_round_trip(workdir: Path, chaos: Chaos) -> Any:
    """Gate a k3-tiny copy with the real quick parity suite, show a byte flipped mid-shard closes the gate and
    restoring it reopens it; returns the gated serve target."""
    from k3verify.checkpoint.synthetic import ensure_preset_checkpoint
    from k3verify.cli import build_parser, main
    from k3verify.commands import serve
    from k3verify.commands.serve_options import ServeOptions
    from k3verify.errors import UsageError

    ckpt, reports = workdir / "k3-tiny", workdir / "reports"
    shutil.copytree(ensure_preset_checkpoint("k3-tiny"), ckpt)
    start = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):  # the parity table; its verdict is noted below
        rc = main(["parity", "--checkpoint", str(ckpt), "--report-dir", str(reports)])
    chaos.notes.append(f"gate: parity --checkpoint (quick) exit {rc} in {time.monotonic() - start:.0f}s")
    args = ServeOptions.from_args(build_parser().parse_args(["serve", "--checkpoint", str(ckpt), "--report-dir",
                                                             str(reports), "--max-batch", "8"]))
    shard = max(ckpt.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    original = shard.read_bytes()
    middle = len(original) // 2
    shard.write_bytes(original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1:])
    try:
        serve.require_gate(args)
        chaos.failures.append("a checkpoint changed after gating was NOT refused")
    except UsageError as exc:
        chaos.notes.append(f"gate: byte {middle} of {shard.name} flipped after gating -> refused ({str(exc)[:90]}...)")
    shard.write_bytes(original)
    gated = serve.require_gate(args)
    chaos.notes.append(f"gate: restored -> accepted ({gated.report.name} under {reports.name}/)")
    return args, gated


def verdicts(chaos: Chaos, restarts: int) -> str:
    status = Counter((o.status or 0) // 100 for o in chaos.outcomes)
    at_fault = [o for o in chaos.outcomes if FAULT in o.error]
    fives_elsewhere = [o for o in chaos.outcomes if (o.status or 0) >= 500 and FAULT not in o.error]
    lost = [o for o in chaos.outcomes if o.status == 200 and not o.final and not o.hung_up]
    lost += [o for o in chaos.outcomes if o.status is None and not o.hung_up]  # closed without an answer
    chaos.failures += [f"5xx outside the fault: {o.kind} {o.status} {o.error[:120]}" for o in fives_elsewhere]
    chaos.failures += [f"lost: {o.kind} status {o.status} {o.error[:120]}" for o in lost]
    if restarts != 1:
        chaos.failures.append(f"expected exactly 1 engine restart, saw {restarts}")
    return (f"sent {len(chaos.outcomes)}, 2xx {status[2]}, 4xx {status[4]}, 5xx {status[5]} "
            f"({sum((o.status or 0) >= 500 for o in at_fault)} at the injected fault, {len(fives_elsewhere)} other), "
            f"engine restarts {restarts}, lost {len(lost)}; in flight at the fault {len(at_fault)} (HTTP 503 or, for "
            f"streams already answered 200, an error event); client hang-ups {sum(o.hung_up for o in chaos.outcomes)} "
            f"({status[0]} before the response headers)")


def run_traffic(url: str, engine: Any, model: str, args: argparse.Namespace, chaos: Chaos) -> str:
    """The traffic phase against a running server, then the after-checks; returns the summary line."""
    asyncio.run(traffic(url, engine, model, args.requests, args.clients, args.seed, chaos))
    deadline = time.monotonic() + 30
    while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(f"{url}/health", timeout=10)
    engine.check_integrity()
    runner = engine.runner
    clean = not runner.active_ids and runner.kv_cache.num_free_pages == runner.kv_cache.num_usable_pages
    chaos.notes.append(f"after: /health {health.status_code} {health.json().get('status')}, caches clean {clean}")
    if health.status_code != 200 or not clean:
        chaos.failures.append(f"unhealthy or dirty after the run: {health.text[:200]}")
    return verdicts(chaos, engine.status().restarts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-clients", type=int, default=64, help="clients under each kill -9 (0: no kill phase)")
    return p.parse_args(argv)


def kill_phase(ckpt: Path, reports: Path, clients: int, chaos: Chaos) -> None:
    """kill -9 of the engine's process, then of the HTTP front end, of a supervised `k3verify serve`."""
    import socket

    from tools.chaos_kill import ServeProcess, kill_engine, kill_front_end

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ServeProcess("--checkpoint", str(ckpt), "--report-dir", str(reports), port=port)
    try:
        chaos.notes.append(f"kill: serve up in {server.wait_healthy(300):.1f}s")
        for result in (kill_engine(server, ckpt.name, clients), kill_front_end(server, ckpt.name, clients)):
            chaos.notes += result.notes
            chaos.failures += result.failures
    finally:
        rc = server.stop()
    if rc != 0:
        chaos.failures.append(f"serve exited {rc} on SIGTERM: {server.log()}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from k3verify.api.app import create_app
    from k3verify.api.metrics import ServerMetrics
    from k3verify.api.thread import ServerThread
    from k3verify.commands import serve

    chaos = Chaos()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k3v-chaos-") as tmp:
        serve_args, gated = gate_round_trip(Path(tmp), chaos)
        engine, tokenizer = serve.build_engine(serve_args, gated)
        metrics = ServerMetrics()
        engine.observer = metrics
        app = create_app(engine.start(), tokenizer, model_name=gated.target.name, metrics=metrics)
        try:
            with ServerThread(app) as server:
                summary = run_traffic(server.url, engine, gated.target.name, args, chaos)
        finally:
            engine.stop()
        if args.kill_clients > 0:
            kill_phase(gated.target.checkpoint_dir, serve_args.report_dir, args.kill_clients, chaos)
    for note in chaos.notes:
        print(note)
    print(f"chaos summary ({time.monotonic() - start:.0f}s): {summary}")
    for failure in chaos.failures[:20]:
        print(f"FAIL {failure}", file=sys.stderr)
    return 1 if chaos.failures else 0


if __name__ == "__main__":
    sys.exit(main())
