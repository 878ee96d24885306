"""Routed-expert combine as two grouped GEMMs: static shapes, no host sync, CUDA-graph capturable.

The torch reference (`kernels/moe/torch_ref.py`) loops over experts with host-side
counts. This path sorts the T·k (token, expert) pairs by expert on the device, gathers the rows,
runs `torch._grouped_mm` against experts stacked as [E, 2I, D] (gate|up) and [E, D, I] (down),
un-sorts the rows and sums each token's k terms in fp32 without atomics (deterministic). Same math,
other GEMM kernels: compared with the reference by an RMS gate, never bit-exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def available() -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    return None


def accepts(moe: Any, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> str | None:
    if x_in.dtype != torch.bfloat16:
        return f"grouped MoE needs bf16 activations; got {x_in.dtype}"
    for name, n in (("expert input width", x_in.shape[-1]), ("expert intermediate", moe.intermediate_size)):
        if n % 16:
            return f"{name} {n} is not a multiple of 16 (grouped GEMM alignment)"
    return None


def moe_grouped_combine(x_in: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        idx: torch.Tensor, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x_in [T, D]; w13 [E, 2I, D] (gate rows then up rows); w2 [E, D, I]; weights [T, k] fp32;
    idx [T, k] -> sum_k w_k expert_k(x_in) as fp32 [T, D]."""
    T, k = idx.shape
    E, two_i, _ = w13.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    rows = order // k
    xs = x_in.index_select(0, rows)  # [T*k, D], grouped by expert
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    g, u = h.split(two_i // 2, dim=-1)
    y = torch._grouped_mm(act(g, u).contiguous(), w2.transpose(1, 2), offs=offs)  # [T*k, D]
    w_sorted = weights.reshape(-1).index_select(0, order)
    # bf16 y times fp32 weights promotes to fp32 in one kernel (the same products as y.float() * w).
    # Un-sort with a permutation (unique targets) and reduce over k: deterministic. An index_add_ over
    # `rows` would add each token's k terms with float atomics in whatever order the GPU runs them,
    # so a CUDA-graph replay and the same step run eagerly could differ in the last bits.
    terms = torch.empty_like(y, dtype=torch.float32).index_copy_(0, order, torch.mul(y, w_sorted[:, None]))
    return terms.view(T, k, -1).sum(dim=1)


def combine_grouped(moe: Any, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Registry entry: the SparseMoE's experts stacked once (`moe.stacked_weights()`), then two grouped GEMMs."""
    w13, w2 = moe.stacked_weights()
    return moe_grouped_combine(x_in, w13, w2, weights, idx, moe.act)
