"""Acceptance and launcher of the one-launch KDA forget gate and beta (kernels/kda/forget_gate_kernel.py): which
calls it takes (a refusal names the value; the registry logs it and runs torch_ref.kda_forget_gate_beta) and a lazy
import so that importing k3verify never imports triton."""

from __future__ import annotations

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module, loaded

BLOCK = 1024  # channels per program
_kernels = lazy_module("k3verify.kernels.kda.forget_gate_kernel", "Triton KDA gate kernel")


def available() -> str | None:
    return cuda_reason(_kernels)


def accepts(f_raw: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, b_logits: torch.Tensor, heads: int,
            lower_bound: float | None) -> str | None:
    if f_raw.dtype != torch.bfloat16 or b_logits.dtype != torch.bfloat16:
        return (f"gate inputs {f_raw.dtype} / {b_logits.dtype} are not bfloat16: the exact fp32 path is the torch "
                "reference (the kernel's exp and log are a few ulps off torch's)")
    if f_raw.dim() != 2 or f_raw.stride(1) != 1 or b_logits.dim() != 2 or b_logits.stride(1) != 1:
        return f"f_raw [T, D] and b_logits [T, h] need unit column strides; got {f_raw.stride()}, {b_logits.stride()}"
    T, D = f_raw.shape
    if b_logits.shape != (T, heads) or D % heads:
        return (f"b_logits must be [{T}, {heads}] and {D} channels a multiple of {heads} heads; got "
                f"{tuple(b_logits.shape)}")
    if dt_bias.shape != (D,) or dt_bias.dtype != torch.float32 or not dt_bias.is_contiguous():
        return f"dt_bias must be contiguous fp32 [{D}]; got {tuple(dt_bias.shape)} {dt_bias.dtype}"
    if A.numel() != heads or A.dtype != torch.float32 or not A.is_contiguous():
        return f"the decay rate A must be contiguous fp32 with {heads} entries; got {tuple(A.shape)} {A.dtype}"
    if heads > BLOCK:
        return f"{heads} heads exceed one program's {BLOCK} beta lanes"
    if not all(t.is_cuda and t.device == f_raw.device for t in (dt_bias, A, b_logits)):
        return f"tensors are not all on {f_raw.device}"
    return None


def forget_gate_beta_triton(f_raw: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, b_logits: torch.Tensor,
                     heads: int, lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ref.kda_forget_gate_beta's contract in one launch (callers go through accepts)."""
    mod = loaded(_kernels)
    T, D = f_raw.shape
    g = torch.empty(T, heads, D // heads, dtype=torch.float32, device=f_raw.device)
    beta = torch.empty(T, heads, dtype=torch.float32, device=f_raw.device)
    if T == 0:
        return g, beta
    mod.kda_forget_gate_beta_kernel[(T, -(-D // BLOCK))](
        f_raw, dt_bias, A, b_logits, g, beta, float(lower_bound or 0.0), f_raw.stride(0), b_logits.stride(0), D,
        D // heads, heads, SAFE=lower_bound is not None, BLOCK=BLOCK,
        BLOCK_H=max(16, 1 << max(heads - 1, 0).bit_length()), num_warps=4)
    return g, beta
