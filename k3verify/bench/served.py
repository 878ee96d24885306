"""`bench --served`: the real engine behind the real HTTP server, under concurrent streaming clients.

The engine runs over the bench's own runner (same model, same caches), decoding through CUDA graphs for
every batch up to the largest concurrency, captured before any client connects at the bench path's decode
context; the server is k3verify.api's app on 127.0.0.1; the clients run in a process of their own
(bench/clients.py). Token ids travel as text: the bench tokenizer renders id i as " i", so every generated
token is one SSE chunk and the streamed text names the ids exactly.

Parity (gates every speed of the run): at each concurrency c, c prompts are sent over HTTP (in order)
while the engine is held (an engine.call that waits until all c were submitted), so its first step admits
all of them: the same packed prefill (same order) and the same decode bucket as the bench path's greedy
generate of those prompts, whose ids the streamed ids must equal bit for bit (at c = 1 two requests, one
after the other). Control: each request's ids against the bench ids of the next prompt.

Speeds: c clients each send `requests_per_client` requests back to back (free-running arrivals): generated
tokens per second of wall time, time to first token and inter-token latency (per token chunk, p50/p99).
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from k3verify.api.app import create_app
from k3verify.api.engine_link import ApiProcess, api_config
from k3verify.api.metrics import EngineMetrics, ServerMetrics
from k3verify.api.thread import ServerThread, server_impl
from k3verify.bench import cpu_stat
from k3verify.bench.speed_parity import judge
from k3verify.bench.speeds import generate_ours, runner_prefill
from k3verify.bench.timing import random_prompt
from k3verify.gates import Kind, Trial
from k3verify.serving.engine import Engine
from k3verify.serving.graphs import GraphDecoder, engine_buckets
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.runner import ModelRunner
from k3verify.serving.warmup import warm_up

MODEL_NAME = "bench"
MIN_STEP_TOKENS = 2048


def step_budget(plan: Any) -> int:
    """Tokens per engine step: enough to admit the largest held wave in one packed prefill (as the bench path
    prefills it), and never below the engine's default."""
    return max(MIN_STEP_TOKENS, max(plan.served_concurrency) * plan.prompt_len)


def beside_bench_path(row: dict[str, Any], decode_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench path's decode tok/s at batch = concurrency (same run) and served / bench."""
    bench = next((r for r in decode_rows if r["batch"] == row["concurrency"]), None)
    if bench is None:
        return row
    return row | {"bench_tok_s": bench["ours_tok_s"], "served_over_bench": row["tok_s"] / bench["ours_tok_s"]}


class IdTokenizer:
    """Token id i is the text " i": one SSE chunk per generated token, and the text names the ids."""

    def __init__(self, vocab_size: int) -> None:
        self.n_vocab = vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        return f" {token_id}".encode()

    def is_special(self, token_id: int) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def no_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    raise ValueError("the bench server answers /v1/completions with token-id prompts only")


@dataclass
class ServedStack:
    url: str
    engine: Engine
    layout: str  # where the HTTP server runs: "api_process" (as `serve` runs it) or "in_process"


def engine_graphs(runner: ModelRunner, bench_graphs: GraphDecoder, concurrencies: tuple[int, ...]) -> GraphDecoder:
    """Graphs for every decode batch up to the largest concurrency at the bench path's decode context (captured
    by served_stack's warm-up, as `serve` captures them before its port opens). Each served concurrency is a
    bucket of its own, as in the bench path: a wave of 12 decodes in a bucket of 12 there, not padded to 16
    (other GEMM shapes)."""
    buckets = tuple(sorted(set(engine_buckets(max(concurrencies))) | set(concurrencies)))
    return GraphDecoder(runner.model, bench_graphs.max_context, buckets=buckets, use_graphs=bench_graphs.use_graphs)


@contextlib.contextmanager
def served_stack(runner: ModelRunner, graphs: GraphDecoder, max_concurrency: int, step_tokens: int,
                 api_process: bool = True, **engine_kw: Any) -> Iterator[ServedStack]:
    """Engine (graph decode, overlap, chunked prefill) here + app + uvicorn on 127.0.0.1, in a process of its own
    linked to the engine as `serve` runs it (api_process) or in this one; stopped on exit. `engine_kw`: more Engine
    settings (the admission hold, say)."""
    cfg = runner.model.cfg
    warm_up(runner, graphs, step_tokens, engine_kw.get("prefill_graphs"))  # as `serve` does before its port opens
    observer = EngineMetrics() if api_process else ServerMetrics()
    engine = Engine(runner, IdTokenizer(cfg.vocab_size), eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                    max_step_tokens=step_tokens, max_running=max_concurrency, graphs=graphs, observer=observer,
                    **engine_kw)
    engine.start()
    try:
        if api_process:
            config = api_config(engine, functools.partial(IdTokenizer, cfg.vocab_size), MODEL_NAME,
                                encode_chat=no_chat)
            with ApiProcess(engine, config, observer.render) as api:
                yield ServedStack(api.url, engine, "api_process")
        else:
            assert isinstance(observer, ServerMetrics)
            app = create_app(engine, IdTokenizer(cfg.vocab_size), model_name=MODEL_NAME, metrics=observer,
                             encode_chat=no_chat)
            with ServerThread(app) as server:
                yield ServedStack(server.url, engine, "in_process")
    finally:
        engine.stop()
    if engine.health() not in (None, "engine stopped"):
        raise RuntimeError(f"the served engine failed: {engine.health()}")


def _client_process(url: str, waves: list[list[list[int]]], new_tokens: int, ordered: bool = False,
                    start_at: float | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "k3verify.bench.clients"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"url": url, "model": MODEL_NAME, "waves": waves, "new_tokens": new_tokens,
                                 "ordered": ordered, "start_at": start_at}))
    proc.stdin.close()
    proc.stdin = None  # written and closed: communicate() must not flush it again
    return proc


def _client_result(proc: subprocess.Popen[str], timeout_s: float = 300.0) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"the client process did not finish within {timeout_s} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"the client process failed (rc {proc.returncode}): {err[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    errors = [r["error"] for r in result["requests"] if r["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} served request(s) failed; first: {errors[0]}")
    return result


def held_wave(stack: ServedStack, prompts: list[list[int]], new_tokens: int, timeout_s: float = 120.0
              ) -> dict[str, Any]:
    """Send one request per prompt while the engine waits, each once the previous one was accepted (so the
    engine admits them in the prompts' order, as the bench path packs them), then let one step admit them all."""
    def accepted() -> int:
        return stack.engine.num_submitted

    release = threading.Event()
    holder = threading.Thread(target=stack.engine.call, args=(lambda: release.wait(timeout_s),),
                              kwargs={"timeout": timeout_s + 10}, daemon=True)
    holder.start()
    # The counter is cumulative over the engine's life: earlier waves already count.
    want = accepted() + len(prompts)
    proc = _client_process(stack.url, [prompts], new_tokens, ordered=True)
    deadline = time.monotonic() + timeout_s
    try:
        while accepted() < want:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{len(prompts)} held requests were not all submitted within {timeout_s} s")
            time.sleep(0.005)
    finally:
        release.set()
        holder.join(timeout_s)
    return _client_result(proc)


def served_ids(record: dict[str, Any]) -> list[int]:
    return [int(t) for t in record["text"].split()]


def served_parity(stack: ServedStack, runner: ModelRunner, bench_graphs: GraphDecoder, concurrency: int,
                  prompt_len: int, new_tokens: int, seed: int, prefill_graphs: GraphPrefill | None = None
                  ) -> dict[str, Any]:
    """Streamed ids of c prompts admitted together == the bench path's greedy ids of the same prompts (its prefill
    through the same prefill graphs as the engine's, when they are on: one pack, one bucket, the same bits)."""
    cfg, device = runner.model.cfg, runner.model.device
    prompts = random_prompt(max(concurrency, 2), prompt_len, cfg.vocab_size, seed, device)
    if prefill_graphs is not None:  # the bucket captured before either side prefills: both replay its graph
        wave = prompts[:1] if concurrency == 1 else prompts
        runner_prefill(runner, wave.tolist(), prefill_graphs, times=prefill_graphs.capture_after)
    if concurrency == 1:  # one request at a time: nothing else shares its batch, as in generate at batch 1
        cand = [served_ids(held_wave(stack, [p.tolist()], new_tokens)["requests"][0]) for p in prompts]
        ref = torch.cat([generate_ours(runner, bench_graphs, p[None], new_tokens, prefill_graphs=prefill_graphs)
                         for p in prompts])
    else:
        cand = [served_ids(r) for r in held_wave(stack, [p.tolist() for p in prompts], new_tokens)["requests"]]
        ref = generate_ours(runner, bench_graphs, prompts, new_tokens, prefill_graphs=prefill_graphs)
    ref = ref.cpu()
    if any(len(c) != new_tokens for c in cand):
        raise RuntimeError(f"served answers of {[len(c) for c in cand]} tokens; asked {new_tokens}")
    trial = Trial(reference=ref, candidate=torch.tensor(cand), control=ref.roll(1, dims=0),
                  notes=[f"{len(prompts)} prompts of {prompt_len} tokens over HTTP, {new_tokens} new tokens, "
                         f"{'one at a time' if concurrency == 1 else 'admitted in one step'}"])
    return judge(f"bench.served_vs_bench_path.c{concurrency}", Kind.BITEXACT, trial)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


CLIENTS_PER_PROCESS = 8
START_DELAY_S = 2.0  # the client processes' common start, after their imports


def run_client_processes(url: str, waves: list[list[list[int]]], new_tokens: int,
                         per_process: int = CLIENTS_PER_PROCESS) -> dict[str, Any]:
    """The clients of `waves` split over one process per `per_process` clients, all starting at one moment; merged
    as one process reports them, with the wall from the first request's start to the last token's arrival
    (perf_counter is the system's monotonic clock: comparable across processes). One Python process parsing
    many streams bounds the measurement itself (it cannot take tokens as fast as a fast engine sends them), and
    a process with many clients spreads a wave's burst of requests over more than the engine's admission hold,
    hence 8 clients a process (2 processes at c16, 8 at c64)."""
    n = len(waves[0])
    procs = -(-n // per_process)
    parts = [list(range(i * n // procs, (i + 1) * n // procs)) for i in range(procs)]
    start_at = time.perf_counter() + START_DELAY_S
    started = [_client_process(url, [[w[j] for j in part] for w in waves], new_tokens, start_at=start_at)
               for part in parts]
    results = [_client_result(p) for p in started]
    requests: list[dict[str, Any]] = []
    order: list[list[int]] = []
    for part, res in zip(parts, results, strict=True):
        requests += res["requests"]
        order += [[part[i], r] for i, r in res["order"]]
    end = max((r["chunk_times"] or [r["start"]])[-1] for r in requests)
    return {"wall_s": end - min(r["start"] for r in requests), "requests": requests, "order": order,
            "client_processes": procs}


def _timed_waves(stack: ServedStack, waves: list[list[list[int]]], new_tokens: int) -> dict[str, Any]:
    """Run the clients over `waves`: wave_stats, the engine steps they took and where those steps' time went."""
    steps, held = stack.engine.num_steps, stack.engine.num_held
    throttled = cpu_stat.throttled_ms()
    stack.engine.record_steps(True)
    try:
        row = wave_stats(run_client_processes(stack.url, waves, new_tokens), new_tokens)
        log = list(stack.engine.step_log or ())
        arrivals = list(stack.engine.arrival_log or ())
    finally:
        stack.engine.record_steps(False)
    after = cpu_stat.throttled_ms()
    return row | {"engine_steps": stack.engine.num_steps - steps, "steps": step_breakdown(log),
                  "arrivals": arrival_bursts(arrivals), "admission_holds": stack.engine.num_held - held,
                  "cpu_throttled_ms": None if throttled is None or after is None else after - throttled,
                  **cpu_stat.host_cpu()}


def arrival_bursts(arrivals: list[float], gap_s: float = 0.05) -> dict[str, Any]:
    """Requests' arrival times at the engine -> bursts (arrivals closer than gap_s to the previous one): how many,
    their median size, spread (first to last arrival) and widest gap inside. A finished wave's clients send
    their next requests as a burst; whether the admission hold (engine.ADMIT_QUIET_S / ADMIT_MAX_HOLD_S) can
    admit a burst in one step depends on that spread and those gaps."""
    times = sorted(arrivals)
    bursts: list[list[float]] = []
    for t in times:
        if bursts and t - bursts[-1][-1] < gap_s:
            bursts[-1].append(t)
        else:
            bursts.append([t])
    if not bursts:
        return {"bursts": 0}
    return {"bursts": len(bursts), "size_p50": statistics.median(len(b) for b in bursts),
            "spread_ms_p50": 1e3 * statistics.median(b[-1] - b[0] for b in bursts),
            "widest_gap_ms_p50": 1e3 * statistics.median(
                max((y - x for x, y in zip(b[:-1], b[1:], strict=True)), default=0.0) for b in bursts)}


def step_breakdown(log: list[tuple[float, int, int]]) -> dict[str, Any]:
    """The engine's step log (launch time, decode rows, prefill tokens) -> how many steps carried prompt tokens, how
    many tokens they carried, and the interval from each launch to the next (the engine launches step n+1 while
    step n runs, so in a busy engine that interval is one step's time), for decode-only steps and for steps with
    prefill, with the prefill steps' share of the time. The last step has no next launch and is not timed."""
    out: dict[str, Any] = {"steps": len(log), "prefill_steps": sum(1 for _, _, p in log if p)}
    if out["prefill_steps"]:
        out["prefill_tokens_per_prefill_step"] = sum(p for _, _, p in log) / out["prefill_steps"]
    gaps = [(b[0] - a[0], a[2] > 0) for a, b in zip(log[:-1], log[1:], strict=True)]
    for name, with_prefill in (("decode_only", False), ("with_prefill", True)):
        ms = [1e3 * g for g, p in gaps if p == with_prefill]
        if ms:
            out[f"{name}_interval_ms_p50"] = statistics.median(ms)
    total = sum(g for g, _ in gaps)
    if total > 0:
        out["prefill_share_of_time"] = sum(g for g, p in gaps if p) / total
    return out


def wave_stats(result: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """Client records (run_client_processes) -> tok/s over wall time, TTFT and ITL (p50/p99), the three slowest
    first tokens; every answer must hold new_tokens tokens."""
    ttft, itl, tokens = [], [], 0
    for rec in result["requests"]:
        n, times = len(served_ids(rec)), rec["chunk_times"]
        if n != new_tokens:
            raise RuntimeError(f"a served answer of {n} tokens; asked {new_tokens}")
        tokens += n
        ttft.append(times[0] - rec["start"])
        itl += [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    # the three slowest first tokens, by (client, its r-th request): a stall shows which wave it hit
    slowest = sorted(zip(ttft, result["order"], strict=True), reverse=True)[:3]
    return {"requests": len(result["requests"]), "tokens": tokens, "wall_s": result["wall_s"],
            "client_processes": result["client_processes"],
            "ttft_slowest": [{"client": o[0], "request": o[1], "ttft_ms": 1e3 * t} for t, o in slowest],
            "tok_s": tokens / result["wall_s"], "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * _pct(ttft, 0.99), "itl_p50_ms": 1e3 * statistics.median(itl),
            "itl_p99_ms": 1e3 * _pct(itl, 0.99)}


def served_speed(stack: ServedStack, cfg_vocab: int, concurrency: int, requests_per_client: int, prompt_len: int,
                 new_tokens: int, seed: int, device: torch.device) -> dict[str, Any]:
    """c clients x requests_per_client streaming requests, free-running: tok/s, TTFT, ITL. One untimed warm-up
    wave of the same shape runs first and is reported beside the timed ones: free-running arrivals make prefill
    steps of token counts the held waves never ran, and their first Triton compiles / fla autotuning (seconds
    each, once per process) would otherwise land inside the timed wall: the TTFT tail would time the compiler,
    not the engine."""
    def waves(first_seed: int, n: int) -> list[list[list[int]]]:
        return [random_prompt(concurrency, prompt_len, cfg_vocab, first_seed + r, device).tolist() for r in range(n)]

    warm = _timed_waves(stack, waves(seed + 10_000, 1), new_tokens)
    row = _timed_waves(stack, waves(seed, requests_per_client), new_tokens)
    return {"concurrency": concurrency, **row, "server": server_impl(), "server_layout": stack.layout,
            "warmup": {k: warm[k] for k in ("requests", "wall_s", "ttft_p99_ms", "engine_steps")}}
