"""Fused router selection on CUDA: one Triton launch per call instead of ~10 torch kernels (sigmoid, bias add,
topk, sort, gather, sum, eps add, divide, scale).

Same contract as torch_ref.route_torch, ungrouped only (groups > topk_group is refused and runs the torch
path). Ids are exactly the torch path's except among exact float ties of s + bias, where torch.topk's order
is unspecified and the kernel takes the lowest index (real scores do not tie). Weights agree to rounding,
not bit for bit: the kernel's sigmoid uses Triton's exp and its own division, and sums the k weights in
its own order. Gates that compare the router bit-exactly pin the torch path (gates/checks).
"""

from __future__ import annotations

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module, loaded

MAX_EXPERTS = 4096  # one row of experts in one block
MAX_TOP_K = 32  # the selection and the ascending emit are each unrolled top_k times


_kernels = lazy_module("k3verify.kernels.router.select_kernel", "triton router kernel")


def available() -> str | None:
    return cuda_reason(_kernels)


def accepts(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, topk_group: int,
            renormalize: bool, scaling: float) -> str | None:
    if groups > topk_group:
        return f"grouped top-k ({groups} groups, best {topk_group} kept) runs on the torch path"
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        return f"logits and bias must be fp32; got {logits.dtype} and {bias.dtype}"
    if logits.dim() != 2:
        return f"logits must be [T, E]; got shape {tuple(logits.shape)}"
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS:
        return f"{E} experts is outside 1..{MAX_EXPERTS} (one block per row)"
    if not 1 <= top_k <= min(E, MAX_TOP_K):
        return f"top_k {top_k} is outside 1..{min(E, MAX_TOP_K)} ({E} experts, unrolled up to {MAX_TOP_K})"
    if bias.shape != (E,):
        return f"bias must be [{E}]; got shape {tuple(bias.shape)}"
    if not (logits.is_contiguous() and bias.is_contiguous()):
        return f"logits / bias must be contiguous; got strides {logits.stride()} and {bias.stride()}"
    if not (logits.is_cuda and bias.device == logits.device):
        return f"tensors are on {logits.device} and {bias.device}, not one CUDA device"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def route_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, topk_group: int,
                 renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 contiguous; bias [E] fp32 -> (weights [T, k] fp32, ids [T, k] int64 ascending).
    Ungrouped only: `groups` / `topk_group` are part of the op's signature, accepts() refuses groups > topk_group."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, idx
    block_e = max(_next_pow2(E), 2)  # no 1-wide vectors: padded experts are -inf, padded slots masked
    loaded(_kernels).router_select_kernel[(T,)](
        logits, bias, weights, idx, E, float(scaling), TOP_K=top_k, BLOCK_E=block_e,
        BLOCK_K=max(_next_pow2(top_k), 2), RENORMALIZE=bool(renormalize and top_k > 1),
        num_warps=1 if block_e <= 256 else 4)
    return weights, idx
