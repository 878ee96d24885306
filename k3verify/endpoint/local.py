"""`parity --endpoint self`: our own server (the serve command's engine and app, ungated) on 127.0.0.1 at a free
port, so the endpoint checks, the mutation runner and CI can verify the HTTP path we ship like any other server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from k3verify.server.app import create_app
from k3verify.server.thread import ServerThread
from k3verify.serving.engine import Engine
from k3verify.serving.graphs import graphs_for
from k3verify.serving.runner import build_runner
from k3verify.target import Target

SELF = "self"


@contextmanager
def serve_locally(target: Target, dtype: torch.dtype, device: torch.device, *, num_slots: int = 8,
                  wrap_runner: Callable[[Any], Any] | None = None) -> Iterator[str]:
    """Serve `target` in `dtype` on `device`; yields the base URL. `wrap_runner` lets tests put a fault in."""
    tokenizer = target.tokenizer()
    runner: Any = build_runner(target.cfg, target.weights(), dtype=dtype, device=device, num_slots=num_slots)
    if wrap_runner is not None:
        runner = wrap_runner(runner)
    graphs = graphs_for(runner.model, runner.max_context, num_slots)  # on CUDA, the graph decode `serve` runs
    engine = Engine(runner, tokenizer, eos_token_ids=target.cfg.eos_token_ids, vocab_size=target.cfg.vocab_size,
                    graphs=graphs)
    app = create_app(engine.start(), tokenizer, model_name=target.name)
    try:
        with ServerThread(app) as server:
            yield server.url
    finally:
        engine.stop()
