"""The prefix cache's workloads in process (no HTTP), with the cache on and off: TTFT p50/p99, throughput, hit rate,
snapshot memory. The GPU rows come from `bench --served`; this runs anywhere (on the CPU with a toy preset).

Workloads (sizes scaled by --scale, 1.0 = the GPU rows' shapes):
- shared: `clients` requests whose prompts share a system prompt of 2048 tokens plus 128 of their own, 64 new
  tokens each, sent together after one request warmed the prefix;
- chat: a multi-turn chat of 8 turns, each turn's prompt the previous prompt, its answer and 128 new tokens;
- unique: `clients` prompts of 2176 tokens sharing nothing (the cache can only cost here).

    python tools/prefix_bench.py --preset k3-tiny --dtype float32 --scale 0.125 --clients 16 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.presets import get_preset
from k3verify.serving.engine import Engine, EngineEvent
from k3verify.serving.prefix_reuse import PrefixSettings
from k3verify.serving.runner import build_runner
from k3verify.serving.sampler import SamplingParams
from k3verify.tokenizer import default_tokenizer


def _engine(args: argparse.Namespace, prefix: bool) -> tuple[Engine, Any]:
    cfg = get_preset(args.preset)
    dtype = getattr(torch, args.dtype)
    ctx = int(2304 * args.scale) + 8 * int(192 * args.scale) + 64
    runner = build_runner(cfg, synthetic_tensors(cfg), dtype=dtype, device=args.device, num_slots=args.clients,
                          page_size=16, num_pages=args.clients * (ctx // 16 + 2) + 64, max_context=ctx)
    if prefix:
        runner.enable_prefix_cache(args.preset, cfg.vocab_size, PrefixSettings(grid=512))
    engine = Engine(runner, default_tokenizer(), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                    max_step_tokens=args.step_tokens).start()
    return engine, runner


def _send(engine: Engine, prompts: list[list[int]], new: int) -> tuple[list[float], list[list[int]], float]:
    """Submit all at once; each one's time to first token (s), its tokens, and the wall time."""
    start = time.perf_counter()
    first: list[float] = [0.0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i: int) -> Any:
        def put(ev: EngineEvent) -> None:
            if ev.token_ids and not tokens[i]:
                first[i] = time.perf_counter() - start
            tokens[i] += ev.token_ids
            if ev.error is not None:
                raise RuntimeError(ev.error)
            if ev.finished:
                done[i].set()
        return put

    for i, p in enumerate(prompts):
        engine.submit(p, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), sink(i))
    for d in done:
        d.wait(3600)
    return first, tokens, time.perf_counter() - start


def _counts(runner: Any) -> tuple[int, int, int]:
    if runner.prefix is None:
        return 0, 0, 0
    c = runner.prefix.cache.counters
    return c.hits, sum(c.misses.values()), c.tokens_reused


def _row(name: str, prefix: bool, ttft: list[float], tokens: int, wall: float, runner: Any,
         before: tuple[int, int, int]) -> dict[str, Any]:
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else ttft * 99
    row: dict[str, Any] = {"workload": name, "cache": "on" if prefix else "off", "requests": len(ttft),
                           "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": q[98], "tokens_per_s": tokens / wall}
    if prefix:
        hits, misses, reused = (a - b for a, b in zip(_counts(runner), before, strict=True))
        row.update(hits=hits, misses=misses, tokens_reused=reused,
                   snapshots=runner.prefix.cache.num_snapshots, snapshot_mib=runner.prefix.cache.snapshot_bytes / 2**20)
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 4000, (n,), generator=g).tolist()

    system, own, new = int(2048 * args.scale), int(128 * args.scale), max(4, int(64 * args.scale))
    common = ids(system)
    shared = [common + ids(own) for _ in range(args.clients)]
    unique = [ids(system + own) for _ in range(args.clients)]
    turns = [ids(own)]
    rows = []
    for prefix in (False, True):
        engine, runner = _engine(args, prefix)
        try:
            _send(engine, [common + ids(own)], new)  # the system prompt, warmed
            before = _counts(runner)
            ttft, toks, wall = _send(engine, shared, new)
            rows.append(_row("shared", prefix, ttft, sum(map(len, toks)), wall, runner, before))
            chat, prompt, total, start, before = [], list(turns[0]), 0, time.perf_counter(), _counts(runner)
            gc = torch.Generator().manual_seed(1)
            for _ in range(8):
                t, answer, _ = _send(engine, [prompt], new)
                chat += t
                total += len(answer[0])
                prompt = prompt + answer[0] + torch.randint(0, 4000, (own,), generator=gc).tolist()
            rows.append(_row("chat", prefix, chat, total, time.perf_counter() - start, runner, before))
            before = _counts(runner)
            ttft, toks, wall = _send(engine, unique, new)
            rows.append(_row("unique", prefix, ttft, sum(map(len, toks)), wall, runner, before))
        finally:
            engine.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--step-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = run(args)
    print("| workload | cache | requests | TTFT p50 (s) | TTFT p99 (s) | tokens/s | hits | tokens reused | snapshots "
          "| snapshot MiB |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['cache']} | {r['requests']} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
              f"{r['tokens_per_s']:.1f} | {r.get('hits', '')} | {r.get('tokens_reused', '')} | "
              f"{r.get('snapshots', '')} | {r['snapshot_mib']:.2f} |" if "snapshot_mib" in r else
              f"| {r['workload']} | {r['cache']} | {r['requests']} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
              f"{r['tokens_per_s']:.1f} | | | | |")
    if args.out is not None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
