"""Real-server harness: the k3-tiny runner (synthetic weights, fp32 on CPU), a recording/fault-injecting
runner proxy, and `running_server`, which puts any runner behind the real app on 127.0.0.1."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from k3verify.api.app import create_app
from k3verify.api.engine_link import ApiProcess, api_config
from k3verify.api.hosts import allowed_hosts as hosts_allowed
from k3verify.api.metrics import EngineMetrics, ServerMetrics
from k3verify.api.thread import ServerThread
from k3verify.serving.engine import Engine

TINY = "k3-tiny"
DTYPE = torch.float32  # fp32 logits move by ~1e-5 with batch composition; greedy tests check for no near-ties


@functools.cache
def tiny_parts() -> tuple[Any, dict[str, torch.Tensor], Any]:
    """(config, synthetic tensors, tokenizer) of k3-tiny, built once per session."""
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.presets import get_preset
    from k3verify.tokenizer import default_tokenizer

    cfg = get_preset(TINY)
    return cfg, synthetic_tensors(cfg), default_tokenizer()


def make_tiny_runner(**kw: Any) -> Any:
    """A fresh k3-tiny ModelRunner (own caches), warmed up so first-call costs stay out of timings."""
    from k3verify.serving.runner import build_runner, generate_greedy

    cfg, tensors, _ = tiny_parts()
    runner = build_runner(cfg, tensors, dtype=DTYPE, device="cpu", **({"num_slots": 8} | kw))
    generate_greedy(runner, [[1, 2, 3]], 2)
    return runner


class RecordingRunner:
    """Proxy over any ModelRunner: records batch sizes and top-2 logit gaps; can delay, block or fail a step."""

    def __init__(self, runner: Any, *, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.runner, self.delay_s, self.gate = runner, delay_s, gate
        self.max_context = runner.max_context
        self.fail_next: BaseException | None = None
        self.prefill_sizes: list[int] = []
        self.decode_sizes: list[int] = []
        self.min_gap = float("inf")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def _step(self, logits: torch.Tensor) -> torch.Tensor:
        top2 = torch.topk(logits.float(), 2, dim=-1).values
        self.min_gap = min(self.min_gap, float((top2[:, 0] - top2[:, 1]).min()))
        return logits

    def _before(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc

    def prefill(self, seqs: list[tuple[int, list[int]]]) -> torch.Tensor:
        self._before()
        self.prefill_sizes.append(len(seqs))
        return self._step(self.runner.prefill(seqs))

    def decode(self, seqs: list[tuple[int, int]]) -> torch.Tensor:
        self._before()
        self.decode_sizes.append(len(seqs))
        return self._step(self.runner.decode(seqs))

    def decode_next(self, seq_ids: list[int], graphs: Any = None) -> torch.Tensor:
        self._before()
        self.decode_sizes.append(len(seq_ids))
        return self._step(self.runner.decode_next(seq_ids, graphs))

    @property
    def max_batch_seen(self) -> int:
        return max(self.prefill_sizes + self.decode_sizes, default=0)

    def assert_empty(self) -> None:
        """Nothing admitted, every page and slot free, invariants intact."""
        self.runner.check_integrity()
        assert self.runner.active_ids == [], f"sequences still admitted: {self.runner.active_ids}"
        kv, pool = self.runner.kv_cache, self.runner.state_pool
        assert kv.num_free_pages == kv.num_usable_pages, f"{kv.num_free_pages} of {kv.num_usable_pages} pages free"
        assert pool.num_free == pool.num_slots, f"{pool.num_free} of {pool.num_slots} state slots free"


def offline_greedy(prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], float]:
    """k3verify.serving.runner.generate_greedy on a fresh runner, and the smallest top-2 logit gap it met."""
    from k3verify.serving.runner import generate_greedy

    rec = RecordingRunner(make_tiny_runner(num_slots=len(prompts)))
    return generate_greedy(rec, prompts, max_new_tokens), rec.min_gap  # type: ignore[arg-type]


def token_text(token_id: int) -> str:
    """A token as the server names it in logprobs."""
    _, _, tok = tiny_parts()
    raw = tok.token_bytes(token_id) if token_id < tok.n_vocab else f"<|unused_{token_id}|>".encode()
    return raw.decode("utf-8", errors="replace")


def greedy_text(ids: Sequence[int]) -> str:
    """The text the server returns for generated ids: cut at the first eos (either kind), specials dropped."""
    cfg, _, tok = tiny_parts()
    for i, t in enumerate(ids):
        if t in cfg.eos_token_ids:
            ids = ids[:i]
            break
    return tok.decode([t for t in ids if t < tok.n_vocab], skip_special=True)


@dataclass
class RunningServer:
    url: str
    engine: Engine
    runner: Any
    metrics: Any  # ServerMetrics; the engine's EngineMetrics with api_process
    model: str
    api: ApiProcess | None = None


@contextmanager
def running_server(runner: Any | None = None, *, api_key: str | None = None, model: str = TINY,
                   tokenizer: Any | None = None, encode_chat: Any = None, eos_ids: Sequence[int] | None = None,
                   vocab_size: int | None = None, default_max_tokens: int = 1024, api_process: bool = False,
                   allowed_hosts: tuple[str, ...] = (), **engine_kw: Any) -> Iterator[RunningServer]:
    """Engine + app + uvicorn on 127.0.0.1 at a free port (k3-tiny unless told otherwise); stopped on exit.
    api_process: the app in a process of its own, linked to the engine here (as `serve` runs it); `metrics` is
    then the engine's EngineMetrics (the app's counters live in the other process)."""
    cfg, _, tiny_tokenizer = tiny_parts()
    runner = runner if runner is not None else RecordingRunner(make_tiny_runner())
    if api_process and (tokenizer is not None or encode_chat is not None):
        raise ValueError("api_process serves the default tokenizer and its chat template only")
    tokenizer = tokenizer or tiny_tokenizer
    metrics: Any = EngineMetrics() if api_process else ServerMetrics()
    engine = Engine(runner, tokenizer, eos_token_ids=eos_ids or cfg.eos_token_ids,
                    vocab_size=vocab_size or cfg.vocab_size, observer=metrics, **engine_kw).start()
    try:
        if api_process:
            from k3verify.tokenizer import default_tokenizer

            config = api_config(engine, default_tokenizer, model, api_key=api_key,
                                default_max_tokens=default_max_tokens, allowed_hosts=allowed_hosts)
            with ApiProcess(engine, config, metrics.render) as api:
                yield RunningServer(api.url, engine, runner, metrics, model, api)
        else:
            app = create_app(engine, tokenizer, model_name=model, api_key=api_key, metrics=metrics,
                             encode_chat=encode_chat, default_max_tokens=default_max_tokens,
                             allowed_hosts=hosts_allowed("127.0.0.1", allowed_hosts))
            with ServerThread(app) as server:
                yield RunningServer(server.url, engine, runner, metrics, model)
    finally:
        engine.stop()
