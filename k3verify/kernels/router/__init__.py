"""Router selection after the fp32 linear: sigmoid, biased top-k (grouped when groups > topk_group), ids
ascending, weights = the uncorrected scores at those ids, renormalized, x scaling.

CPU runs the torch reference (torch_ref, Router.forward's old math op for op); CUDA runs one Triton kernel
per call for ungrouped routing, else the torch reference with a logged reason (kernels/registry.py).
"""

from __future__ import annotations

import torch

from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, dispatch
from k3verify.kernels.router import select_launch, torch_ref

SELECT = "router.select"

REGISTRY.register(SELECT, TORCH, torch_ref.route_torch)
REGISTRY.register(SELECT, TRITON, select_launch.route_triton, accepts=select_launch.accepts,
                  available=select_launch.available)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, topk_group: int, renormalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 (x.float() @ W.float().T); bias [E] fp32 -> (weights [T, k] fp32, ids [T, k] int64
    ascending per row). See torch_ref.route_torch."""
    return dispatch(SELECT, logits, bias, top_k, groups, topk_group, renormalize, scaling, device=logits.device)
