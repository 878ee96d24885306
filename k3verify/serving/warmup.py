"""Start-up warm-up: pay Triton's compiles, fla's autotuning and the CUDA-graph captures before the first request.

A Triton kernel compiles once per specialisation of its integer arguments (== 1, divisible by 16, other) and
fla's autotuners run once per key, so the first prefill of a new token count can stall every stream for seconds,
and a cold server's first clients wait for compiles instead of tokens. The warm-up captures every decode bucket
(the captures' own warm-up steps run on scratch rows) and prefills a ladder of token counts, one sequence and a
pack of several, on sequences it admits and releases: afterwards the caches hold no sequence, every slot and page
is free again, and what the warm-up wrote is overwritten before anything reads it (a slot is zeroed when allocated;
attention reads only positions a sequence has written).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from k3verify.serving.graphs import GraphDecoder
from k3verify.serving.prefill_graphs import GraphPrefill
from k3verify.serving.runner import ModelRunner

log = logging.getLogger("k3verify.warmup")


@dataclass(frozen=True)
class WarmupReport:
    buckets: tuple[int, ...]  # decode buckets captured
    prefills: tuple[tuple[int, ...], ...]  # the token counts of each warm-up prefill's sequences
    seconds: float

    def describe(self) -> str:
        return (f"warm-up {self.seconds:.1f} s: {len(self.buckets)} decode graph bucket(s) captured, "
                f"{len(self.prefills)} prefill shape(s) up to {max((sum(p) for p in self.prefills), default=0)} "
                "tokens")


def prefill_ladder(max_tokens: int, pack: int = 4) -> list[tuple[int, ...]]:
    """Token counts to warm: powers of two and their odd neighbours (both specialisations of each size) up to
    max_tokens as one sequence, then the same totals split over `pack` sequences (varlen offsets)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
    sizes = sorted({n for p in range(max_tokens.bit_length()) for n in (1 << p, (1 << p) + 1) if n <= max_tokens}
                   | {max_tokens})
    packed = [tuple([n // pack] * (pack - 1) + [n - (pack - 1) * (n // pack)]) for n in sizes if n >= 4 * pack]
    return [(n,) for n in sizes] + packed


def warm_up(runner: ModelRunner, graphs: GraphDecoder | None, max_step_tokens: int,
            prefill_graphs: GraphPrefill | None = None) -> WarmupReport:
    """Capture every decode bucket of `graphs` and run the prefill ladder up to max_step_tokens (no more than
    fits the free cache and the free state slots); with `prefill_graphs`, each rung also through their static step
    without a graph (fla's graph-mode kernels compile here; a bucket's capture, on its second use, then pays no
    compile)."""
    if runner.active_ids:
        raise RuntimeError(f"warm-up needs an idle runner; sequences {runner.active_ids} are admitted")
    start = time.perf_counter()
    buckets: tuple[int, ...] = ()
    if graphs is not None and graphs.use_graphs:
        for bucket in graphs.buckets:
            graphs.ensure_captured(bucket)  # a graph still valid from an earlier warm-up is kept
        buckets = graphs.buckets
    paths: list[GraphPrefill | None] = [None]
    if prefill_graphs is not None:
        paths.append(GraphPrefill(runner.model, max_tokens=prefill_graphs.max_tokens,
                                  max_seqs=prefill_graphs.max_seqs, use_graphs=False))
    done = []
    for lengths in prefill_ladder(min(max_step_tokens, runner.max_context)):
        if len(lengths) > runner.state_pool.num_free or not all(runner.can_ever_fit(n) for n in lengths):
            continue
        if all(_warm_prefill(runner, lengths, path) for path in paths):
            done.append(lengths)
    if runner.model.device.type == "cuda":
        torch.cuda.synchronize()
    report = WarmupReport(buckets, tuple(done), time.perf_counter() - start)
    log.info("%s", report.describe())
    return report


def _warm_prefill(runner: ModelRunner, lengths: tuple[int, ...], path: GraphPrefill | None) -> bool:
    """Admit sequences of `lengths`, prefill them (through `path`'s static step when given), release; False when
    they do not fit the free cache now."""
    ids = list(range(len(lengths)))
    admitted = []
    try:
        for sid, n in zip(ids, lengths, strict=True):
            if not runner.can_admit(n):
                return False
            runner.admit(sid, n)
            admitted.append(sid)
        seqs = [(sid, [0] * n) for sid, n in zip(ids, lengths, strict=True)]
        with torch.no_grad():
            runner.prefill(seqs, path)
        return True
    finally:
        for sid in admitted:
            runner.release(sid)
