"""Timing helpers: CUDA events after warm-up, median of repeats, inputs never all zeros."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    repeats: int

    def rate(self, units: float) -> float:
        return units / self.median_s


def cuda_time(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 5) -> Timing:
    """CUDA events around each call; without CUDA (dry runs of the bench logic) a wall clock."""
    if not torch.cuda.is_available():
        return _wall_time(fn, warmup, repeats)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return Timing(statistics.median(times), min(times), repeats)


def random_prompt(batch: int, length: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    """Token ids drawn uniformly from the non-special range (never all zeros)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(1, min(vocab, 160000) - 1, (batch, length), generator=g).to(device)


def _wall_time(fn: Callable[[], object], warmup: int, repeats: int) -> Timing:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), min(times), repeats)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
