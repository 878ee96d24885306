"""Acceptance and launcher of the Triton MXFP4 grouped GEMM (kernels/mxfp4/grouped_kernel.py): availability,
per-call acceptance with a reason, tile sizes, and a lazy import so that importing k3verify never
imports triton."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module

MAX_EXPERTS = 4096  # the tile search holds every expert's row count in one block
GROUP_TILES = 8  # row tiles whose activations stay in L2 while the weights stream past


_kernels = lazy_module("k3verify.kernels.mxfp4.grouped_kernel", "Triton MXFP4 grouped GEMM")


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def available() -> str | None:
    return cuda_reason(_kernels)


def accepts(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor, group: int) -> str | None:
    if x.dtype != torch.bfloat16:
        return f"the MXFP4 kernel decodes into bf16 dots: activations must be bf16; got {x.dtype}"
    if x.dim() != 2 or codes.dim() != 3 or scales.dim() != 3:
        return f"expected x [M, K], codes [E, N, K/2], scales [E, N, K/g]; got {tuple(x.shape)}, " \
               f"{tuple(codes.shape)}, {tuple(scales.shape)}"
    (M, K), (E, N, half) = x.shape, codes.shape
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        return f"codes and scales must be uint8; got {codes.dtype} and {scales.dtype}"
    if group < 2 or group % 2 or group & (group - 1):
        return f"MXFP4 group {group} is not an even power of two"
    if K % group or half * 2 != K or scales.shape != (E, N, K // group):
        return f"shapes do not fit group {group}: x {tuple(x.shape)}, codes {tuple(codes.shape)}, " \
               f"scales {tuple(scales.shape)}"
    if offs.shape != (E,) or offs.dtype != torch.int32:
        return f"offs must be int32 [{E}]; got {offs.dtype} {tuple(offs.shape)}"
    if not 1 <= E <= MAX_EXPERTS:
        return f"{E} experts is outside 1..{MAX_EXPERTS}"
    if x.stride(1) != 1 or codes.stride(2) != 1 or scales.stride(2) != 1:
        return f"rows must be contiguous; got strides {x.stride()}, {codes.stride()}, {scales.stride()}"
    if M >= 2**31:
        return f"{M} rows overflow the kernel's int32 row index"
    if not all(t.is_cuda and t.device == x.device for t in (codes, scales, offs)):
        return f"tensors are not all on {x.device}"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pick_tiles(rows: int, experts: int, group: int) -> Tiles:
    """Row tiles sized to the mean rows per routed expert: decode (a few rows each) reads every weight
    byte once with the smallest dot the tensor cores take (16 rows); prefill reuses each decoded tile
    over 128 rows."""
    per_expert = rows / max(min(experts, rows), 1)
    if per_expert <= 16:
        return Tiles(16, 64, max(128, group), 4, 4)
    if per_expert <= 64:
        return Tiles(64, 64, max(128, group), 4, 3)
    return Tiles(128, 128, max(64, group), 8, 3)


def grouped_mm_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor,
                      group: int) -> torch.Tensor:
    """Same contract as torch_ref.grouped_mm_torch (callers check `accepts`)."""
    mod = _kernels()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    return launch(mod, x, codes, scales, offs, group)


def launch(mod: ModuleType, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor,
           group: int) -> torch.Tensor:
    """Run `mod.mxfp4_grouped_mm_kernel` (the kernel module, or a test's variant of it) on one call."""
    M, K = x.shape
    E, N, _ = codes.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    t = pick_tiles(M, E, group)
    num_tiles = M // t.block_m + min(E, M)  # >= sum_e ceil(rows_e / BM): at most one partial tile per expert
    grid = (num_tiles * -(-N // t.block_n),)
    mod.mxfp4_grouped_mm_kernel[grid](
        x, codes, scales, offs, y, N, K, E, num_tiles, x.stride(0), codes.stride(0), codes.stride(1),
        scales.stride(0), scales.stride(1), y.stride(0), GROUP=group, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, BLOCK_E=max(_next_pow2(E), 2), GROUP_T=GROUP_TILES, num_warps=t.num_warps,
        num_stages=t.num_stages)
    return y
