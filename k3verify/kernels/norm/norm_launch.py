"""Fused RMSNorm / gated RMSNorm on CUDA: one Triton launch per call instead of ~6 / ~10 torch kernels.

Same contract and the same roundings as torch_ref (fp32 statistics, the normalized row cast to x's
dtype before the weight multiply, the gated form cast once at the end); only the reduction order
and the rsqrt differ, so outputs agree to rounding, never bit for bit. fp32 activations are refused:
the fp32 gates compare the serving model with the oracle bit-exactly, and only the torch path is
op-for-op the oracle's.
"""

from __future__ import annotations

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module, loaded

MAX_BLOCK = 8192  # wider rows loop over BLOCK-wide chunks (K3 hidden 7168 fits one)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUTED_DTYPES = (torch.bfloat16, torch.float16)

_kernels = lazy_module("k3verify.kernels.norm.norm_kernel", "triton norm kernels")


def available() -> str | None:
    return cuda_reason(_kernels)


def _row_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dtype not in ROUTED_DTYPES:
        return (f"{x.dtype} activations: the exact path is the torch reference (the fp32 gates are bit-exact "
                f"against it); the Triton norm runs for {ROUTED_DTYPES}")
    if weight.dtype not in KERNEL_DTYPES:
        return f"weight dtype {weight.dtype} is not one of {KERNEL_DTYPES}"
    if x.dim() == 0 or x.shape[-1] == 0:
        return f"x of shape {tuple(x.shape)} has no last dim to normalize over"
    if weight.shape != (x.shape[-1],) or weight.stride() != (1,):
        return f"weight must be contiguous [{x.shape[-1]}]; got shape {tuple(weight.shape)}, stride {weight.stride()}"
    if x.stride(-1) != 1:
        return f"x's last dim is not contiguous (stride {x.stride(-1)})"
    if not (x.is_cuda and weight.device == x.device):
        return f"tensors are on {x.device} and {weight.device}, not one CUDA device"
    return None


def accepts_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    return _row_reason(x, weight)


def accepts_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        return (f"residual {tuple(residual.shape)} {residual.dtype} differs from x {tuple(x.shape)} {x.dtype} "
                "(no broadcasting or promotion here)")
    reason = _row_reason(x, weight)
    if reason is not None:
        return reason
    if residual.device != x.device or residual.stride(-1) != 1:
        return f"residual must be on {x.device} with a contiguous last dim; got {residual.device}, stride " \
               f"{residual.stride(-1)}"
    return None


def accepts_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if gate.shape != x.shape:
        return f"gate shape {tuple(gate.shape)} differs from x shape {tuple(x.shape)} (no broadcasting here)"
    reason = _row_reason(x, weight)
    if reason is not None:
        return reason
    if gate.device != x.device or gate.stride(-1) != 1:
        return f"gate must be on {x.device} with a contiguous last dim; got {gate.device}, stride {gate.stride(-1)}"
    return None


def _launch_shape(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of `width` elements."""
    block = min(1 << max(width - 1, 0).bit_length(), MAX_BLOCK)  # next power of two, capped
    return block, min(max(block // 256, 1), 16)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., W] (last dim contiguous); weight [W] -> [..., W] in promote_types(weight.dtype, x.dtype)."""
    W = x.shape[-1]
    x2 = x.reshape(-1, W)  # rows; a view unless the leading dims cannot be flattened
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0] == 0:
        return y
    block, num_warps = _launch_shape(W)
    loaded(_kernels).rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, weight, y, x2.stride(0), W, W, eps, BLOCK=block, num_warps=num_warps)
    return y


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., W] (last dims contiguous); weight [W] -> (x + residual in x's dtype, its RMSNorm): one
    launch for the add and the norm, the same bits as the add followed by rms_norm_triton."""
    W = x.shape[-1]
    x2, r2 = x.reshape(-1, W), residual.reshape(-1, W)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0] == 0:
        return s, y
    block, num_warps = _launch_shape(W)
    loaded(_kernels).add_rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, r2, weight, s, y, x2.stride(0), r2.stride(0), W, W, W, eps, BLOCK=block, num_warps=num_warps)
    return s, y


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., W] (last dims contiguous); weight [W] -> [..., W] in x.dtype."""
    W = x.shape[-1]
    x2, g2 = x.reshape(-1, W), gate.reshape(-1, W)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return y
    block, num_warps = _launch_shape(W)
    loaded(_kernels).gated_rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, g2, weight, y, x2.stride(0), g2.stride(0), W, W, eps, BLOCK=block, num_warps=num_warps)
    return y
