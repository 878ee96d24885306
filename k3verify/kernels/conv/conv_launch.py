"""Launch of the Triton conv decode (kernels/conv/decode_kernel.py): availability, per-call acceptance and
a lazy import, so that importing the conv package never imports triton."""

from __future__ import annotations

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module

_DTYPES = (torch.bfloat16,)
MAX_WIDTH = 8  # the kernel unrolls the taps


_kernel_module = lazy_module("k3verify.kernels.conv.decode_kernel", "Triton conv decode kernel")
_prefill_module = lazy_module("k3verify.kernels.conv.prefill_kernel", "Triton conv prefill kernel")


def available() -> str | None:
    return cuda_reason(_kernel_module)


def available_prefill() -> str | None:
    return cuda_reason(_prefill_module)


def _qkv_reason(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> str | None:
    """What both conv kernels need of q/k/v ([rows, D] alike) and their weights ([D, W] in the same dtype)."""
    dtype, shape, W = xs[0].dtype, xs[0].shape, weights[0].shape[-1]
    if dtype not in _DTYPES:
        return (f"activation dtype {dtype} is not one of {_DTYPES}: the exact fp32 path is the torch reference "
                "(the kernel's SiLU exp is a few ulps off torch's)")
    if any(x.shape != shape or x.dtype != dtype for x in xs):
        return f"q/k/v inputs differ in shape or dtype: {[(tuple(x.shape), x.dtype) for x in xs]}"
    D = shape[-1]
    if any(w.shape != (D, W) or w.dtype != dtype for w in weights):
        return f"conv weights must be [{D}, W] in {dtype}; got {[(tuple(w.shape), w.dtype) for w in weights]}"
    if not 2 <= W <= MAX_WIDTH:
        return f"conv width {W} is outside the unrolled range [2, {MAX_WIDTH}]"
    return None


def accepts_prefill(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seg_ids: torch.Tensor,
                    local_pos: torch.Tensor, cu_seqlens: torch.Tensor,
                    initial: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> str | None:
    dtype, (T, D), W = xs[0].dtype, xs[0].shape, weights[0].shape[-1]
    reason = _qkv_reason(xs, weights)
    if reason is not None:
        return reason
    N = cu_seqlens.numel() - 1
    if initial is not None and any(t.shape != (N, D, W - 1) or t.dtype != dtype for t in initial):
        return (f"initial windows must be [{N}, {D}, {W - 1}] in {dtype}; "
                f"got {[(tuple(t.shape), t.dtype) for t in initial]}")
    if seg_ids.shape != (T,) or local_pos.shape != (T,):
        return f"seg_ids / local_pos must be [{T}]; got {tuple(seg_ids.shape)}, {tuple(local_pos.shape)}"
    if not all(t.is_cuda for t in (*xs, *weights, seg_ids, local_pos, cu_seqlens, *(initial or ()))):
        return "tensors are not all on CUDA"
    return None


def causal_conv_qkv_fast(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seg_ids: torch.Tensor,
                         local_pos: torch.Tensor, cu_seqlens: torch.Tensor,
                         initial: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                         ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    mod = _prefill_module()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    return mod.causal_conv_qkv_triton(xs, weights, seg_ids, local_pos, cu_seqlens, initial)


def accepts_decode(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], slots: torch.Tensor,
                   keep: torch.Tensor) -> str | None:
    (B, D), W = xs[0].shape, weights[0].shape[-1]
    reason = _qkv_reason(xs, weights)
    if reason is not None:
        return reason
    if any(t.dtype != torch.float32 or t.shape[1:] != (D, W - 1) for t in windows):
        return f"windows must be fp32 [slots, {D}, {W - 1}]; got {[(tuple(t.shape), t.dtype) for t in windows]}"
    if len({(t.shape, t.stride()) for t in windows}) != 1:
        return "the three window views differ in shape or stride (the kernel shares one set of strides)"
    if slots.shape != (B,) or keep.shape != (B,) or slots.dtype != torch.int64:
        return f"slots / keep must be [{B}] (slots int64); got {tuple(slots.shape)} {slots.dtype}, {tuple(keep.shape)}"
    if not all(t.is_cuda for t in (*xs, *weights, *windows, slots, keep)):
        return "tensors are not all on CUDA"
    return None


def conv_decode_qkv_fast(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], slots: torch.Tensor,
                         keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mod = _kernel_module()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    return mod.conv_decode_qkv_triton(xs, weights, windows, slots, keep)
