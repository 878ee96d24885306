"""Helpers of the spec.* checks: op-level score inputs over a sentinel-filled pool, bit views, poisoning."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3verify.gates import SkipCheck
from k3verify.serving.runner import ModelRunner

NUM_DRAFT = 4
SLOTS = [2, 5, 1]  # scored rows park in these pool slots; the others are idle sentinels
NUM_SLOTS = 6
IDLE = [0, 3, 4]


@dataclass
class OpCase:
    """One KDA layer's score inputs: xs 3 x [B, n, D], conv weights 3 x [D, W], g / gate [B, n, h, dk], beta
    [B, n, h], a pool (windows 3 x [NUM_SLOTS, D, W-1], state [NUM_SLOTS, h, dk, dv]) with NaN / 1e30 in the
    idle slots, slots [B], keep [B], norm weight [dk]."""

    xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    state: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    gate: torch.Tensor
    norm_weight: torch.Tensor
    slots: torch.Tensor
    keep: torch.Tensor
    scale: float
    eps: float

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, n, h, dk = self.g.shape
        return B, n, h, dk

    def pool_copy(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        w = self.windows
        return (w[0].clone(), w[1].clone(), w[2].clone()), self.state.clone()


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    t[IDLE[0::2]] = float("nan")
    t[IDLE[1::2]] = 1e30
    return t


def _three(make: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three draws, q / k / v in that order (Python evaluates a tuple left to right; the generator's order
    fixes every check's inputs)."""
    return make(), make(), make()


def op_case(ctx: Any, dtype: torch.dtype, rows: int = len(SLOTS), num_draft: int = NUM_DRAFT) -> OpCase:
    """ctx: a CheckContext, or anything with cfg, generator and device (the bench)."""
    if not ctx.cfg.has_kda:
        raise SkipCheck("preset has no KDA layers")
    cfg, gen, dev = ctx.cfg, ctx.generator, ctx.device
    h, dk, D, W, n = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.conv_kernel_size, num_draft + 1
    slots = (SLOTS * rows)[:rows]  # rows > len(SLOTS) reuse slots: still one read-only pool per call

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    xs = _three(lambda: rnd(rows, n, D).to(dtype).to(dev))
    weights = _three(lambda: (rnd(D, W) * 0.5).to(dtype).to(dev))
    windows = _three(lambda: _sentinel(rnd(NUM_SLOTS, D, W - 1).to(dtype).float()).to(dev))
    state = _sentinel(rnd(NUM_SLOTS, h, dk, dk, scale=0.3)).to(dev)
    g = (-torch.rand(rows, n, h, dk, generator=gen) * 0.7 - 0.01).to(dev)  # log decay in (-0.71, -0.01)
    beta = torch.rand(rows, n, h, generator=gen).to(dev)
    gate = rnd(rows, n, h, dk).to(dtype).to(dev)
    norm_weight = (1.0 + rnd(dk, scale=0.1)).to(dev)
    return OpCase(xs, weights, windows, state, g, beta, gate, norm_weight,
                  torch.tensor(slots, device=dev), torch.ones(rows, dtype=dtype, device=dev), dk**-0.5,
                  cfg.rms_norm_eps)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits (NaN == NaN when the bits match): bit-exact comparison of poisoned storage."""
    t = t.contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def poison_caches(runner: ModelRunner) -> None:
    """NaN in every page and slot: whatever a pass reads that nobody wrote shows up (allocation zeroes a slot;
    pages are handed out as they are)."""
    runner.kv_cache.data.fill_(float("nan"))
    for t in runner.state_pool.tensors().values():
        t.fill_(float("nan"))
