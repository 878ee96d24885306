"""Routed-expert combine: sum_k w_k expert_k(x) in fp32.

CPU runs the torch reference (a loop over the experts that were hit, host-side counts); CUDA runs two
grouped GEMMs (bf16) or a per-pair weight gather with batched GEMVs (other dtypes), static shapes and no
host sync (CUDA-graph capturable), when they accept the call, else the reference with a logged reason
(kernels/registry.py)."""

from __future__ import annotations

from typing import Any

import torch

from k3verify.kernels.moe import grouped, torch_ref
from k3verify.kernels.registry import CUDA, REGISTRY, TORCH, dispatch

COMBINE = "moe.combine"

REGISTRY.register(COMBINE, TORCH, torch_ref.combine_loop)
REGISTRY.register(COMBINE, CUDA, grouped.combine_grouped, accepts=grouped.accepts, available=grouped.available)


def moe_combine(moe: Any, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """moe: the SparseMoE (expert weights, activation); x_in [T, D]; weights [T, k] fp32; idx [T, k]
    -> [T, D] fp32; with `add` [T, D] (the shared expert's output) -> that sum rounded to add's dtype plus add,
    in add's dtype (on CUDA's decode kernels one launch with the k-sum)."""
    return dispatch(COMBINE, moe, x_in, weights, idx, add=add, device=x_in.device)
