"""The HTTP layer's own ceiling: how many streamed tokens per second the server and the bench's clients carry when
the engine costs nothing (diagnostic, CPU).

A stub engine emits, every `--step-ms`, one token to every request it holds (a decode step at batch = requests
held; prefill is free), through the real app (`create_app`), uvicorn (`ServerThread`) and the served bench's
client processes (`k3verify.bench.clients`). Printed per run: delivered tok/s against the engine's own rate
(requests held x 1000 / step_ms), TTFT p50 and ITL p50 / p99. If the delivered rate falls short of the engine's,
the HTTP side (server or clients), not the model, bounds `bench --served` at that concurrency.

    python -m lab.http_ceiling --concurrency 64 --step-ms 6 --per-process 64,16
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from types import SimpleNamespace
from typing import Any, cast

from k3verify.api.app import create_app
from k3verify.api.metrics import ServerMetrics
from k3verify.api.thread import ServerThread
from k3verify.bench.served import MODEL_NAME, IdTokenizer, no_chat, run_client_processes, wave_stats
from k3verify.serving.engine import Engine
from k3verify.serving.events import EngineEvent, TokenText


class StubEngine:
    """What the completions endpoint uses of Engine, with a step loop that costs nothing but the events."""

    def __init__(self, step_ms: float, vocab_size: int = 4096) -> None:
        self.step_s, self.vocab_size = step_ms / 1e3, vocab_size
        self.token_text = TokenText(IdTokenizer(vocab_size))
        self.lock = threading.Lock()
        self.held: dict[int, list[Any]] = {}  # seq_id -> [sink, tokens left, emitted, prompt tokens]
        self.ids = itertools.count(1)
        self.steps = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.limits = SimpleNamespace(max_model_len=1 << 20)  # read by GET /v1/models (the clients' warm-up)

    def submit(self, prompt_ids: list[int], params: Any, sink: Any) -> int:
        sid = next(self.ids)
        with self.lock:
            self.held[sid] = [sink, params.max_tokens, 0, len(prompt_ids)]
        return sid

    def abort(self, seq_id: int) -> None:
        with self.lock:
            self.held.pop(seq_id, None)

    def health(self) -> str | None:
        return None

    def _loop(self) -> None:
        next_t = time.perf_counter()
        while not self.stopped.is_set():
            next_t += self.step_s
            with self.lock:
                batch = list(self.held.items())
            for sid, rec in batch:
                sink, left, done, prompt = rec
                tok = (sid * 7 + done) % self.vocab_size
                rec[1], rec[2] = left - 1, done + 1
                last = rec[1] == 0
                sink(EngineEvent(text=f" {tok}", token_ids=[tok], finish_reason="length" if last else None,
                                 prompt_tokens=prompt, completion_tokens=rec[2]))
                if last:
                    self.abort(sid)
            if batch:
                self.steps += 1
            time.sleep(max(0.0, next_t - time.perf_counter()))


def run(concurrency: int, step_ms: float, per_process: int, waves: int, new_tokens: int) -> dict[str, Any]:
    """`concurrency` clients x `waves` streaming requests of `new_tokens` against the stub engine."""
    engine = StubEngine(step_ms)
    engine.thread.start()
    # the stub has what the streaming completions endpoint and GET /v1/models use of an Engine (submit, abort,
    # health, vocab_size, token_text, limits.max_model_len), nothing more: another endpoint would fail loudly
    metrics = ServerMetrics()
    app = create_app(cast(Engine, engine), IdTokenizer(engine.vocab_size), model_name=MODEL_NAME, metrics=metrics,
                     encode_chat=no_chat)
    prompt = list(range(1, 129))
    try:
        with ServerThread(app) as server:
            result = run_client_processes(server.url, [[prompt] * concurrency for _ in range(waves)], new_tokens,
                                          per_process)
    finally:
        engine.stopped.set()
    warm = next((float(line.split()[-1]) for line in metrics.render().decode().splitlines()
                 if line.startswith("k3v_requests_total") and 'endpoint="/v1/models"' in line), 0.0)
    return {"concurrency": concurrency, "step_ms": step_ms, "engine_rate": concurrency * 1e3 / step_ms,
            "engine_steps": engine.steps, "warm_up_requests": int(warm), **wave_stats(result, new_tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--step-ms", type=float, default=6.0)
    ap.add_argument("--per-process", default="16", help="clients per client process (comma list: one run each)")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    rows = [run(c, a.step_ms, p, a.waves, a.new_tokens) for c in map(int, a.concurrency.split(","))
            for p in map(int, a.per_process.split(","))]
    print("clients procs step_ms  engine tok/s  delivered tok/s  ratio  TTFT p50  ITL p50  ITL p99")
    for r in rows:
        print(f"{r['concurrency']:7d} {r['client_processes']:5d} {r['step_ms']:7.1f} {r['engine_rate']:13,.0f} "
              f"{r['tok_s']:16,.0f} {r['tok_s'] / r['engine_rate']:6.2f} {r['ttft_p50_ms']:7.1f}ms "
              f"{r['itl_p50_ms']:6.2f}ms {r['itl_p99_ms']:7.2f}ms")


if __name__ == "__main__":
    main()
