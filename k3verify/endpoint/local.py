"""`parity --endpoint self`: our own server (the serve command's engine and app, ungated) on 127.0.0.1 at a free
port, so the endpoint checks, the mutation runner and CI can verify the HTTP path we ship like any other server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from k3verify.api.engine_link import ApiProcess, api_config
from k3verify.api.metrics import EngineMetrics
from k3verify.serving.engine import Engine
from k3verify.serving.graphs import graphs_for
from k3verify.serving.prefix_reuse import PrefixSettings
from k3verify.serving.runner import build_runner
from k3verify.target import Target

SELF = "self"


@contextmanager
def serve_locally(target: Target, dtype: torch.dtype, device: torch.device, *, num_slots: int = 8,
                  wrap_runner: Callable[[Any], Any] | None = None, prefix_cache: bool = True) -> Iterator[str]:
    """Serve `target` in `dtype` on `device` (with the prefix cache, as `serve` does by default); yields the base
    URL. `wrap_runner` lets tests put a fault in."""
    files = target.tokenizer_bytes()  # the engine's tokenizer and the API process's come from the same bytes
    tokenizer = files.load()
    runner: Any = build_runner(target.cfg, target.weights(), dtype=dtype, device=device, num_slots=num_slots)
    if prefix_cache:
        runner.enable_prefix_cache(target.digest, target.cfg.vocab_size, PrefixSettings())
    if wrap_runner is not None:
        runner = wrap_runner(runner)
    graphs = graphs_for(runner.model, runner.max_context, num_slots)  # on CUDA, the graph decode `serve` runs
    engine = Engine(runner, tokenizer, eos_token_ids=target.cfg.eos_token_ids, vocab_size=target.cfg.vocab_size,
                    graphs=graphs)
    observer = EngineMetrics()
    engine.observer = observer
    observer.watch_prefix_cache(lambda: runner.prefix)
    config = api_config(engine.start(), files.load, target.name)
    try:
        with ApiProcess(engine, config, observer.render) as api:  # the HTTP server in its own process, as serve runs
            yield api.url
    finally:
        engine.stop()
