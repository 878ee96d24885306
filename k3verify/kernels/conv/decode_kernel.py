"""Triton decode step of the q/k/v short convs: one launch for all three, windows updated in the pool.

Program (b, block) handles row b and BLOCK_D channels of all three convs: it reads the row's window
straight from the fp32 pool at slots[b], forms silu(conv) and writes the shifted window back. The
arithmetic mirrors torch's elementwise ops in the activation dtype (fp32 math, rounded to bf16 after
every multiply and add), so outputs differ from the torch reference only where exp / division do.

Imports triton at module level: import it lazily (kernels/conv/conv_launch.py), and for the
interpreter set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_D = 512


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. Explicit integer rounding: the Triton
    interpreter truncates on .to(tl.bfloat16) while the GPU rounds to nearest, so neither cast is relied on."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _round(x, BF16: tl.constexpr):
    if BF16:
        x = _round_bf16(x)
    return x


@triton.jit
def _conv_row(x_ptr, w_ptr, win_ptr, out_ptr, b, slot, keep, d, mask, D, s_x, s_slot, s_d, s_tap,
              W: tl.constexpr, BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    """One conv, one row: taps oldest first, acc = round(acc + round(tap * w)), then silu."""
    win = win_ptr + slot * s_slot + d * s_d
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        tap = _round(tl.load(win + j * s_tap, mask=mask, other=0.0), BF16) * keep  # keep is 0.0 / 1.0
        w = tl.load(w_ptr + d * W + j, mask=mask, other=0.0).to(tl.float32)
        acc = _round(acc + _round(tap * w, BF16), BF16)
        if j > 0:  # shift: tap j moves to j-1 (tap j-1 was read one iteration earlier)
            tl.store(win + (j - 1) * s_tap, tap, mask=mask)
    x = tl.load(x_ptr + b * s_x + d, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    acc = _round(acc + _round(x * w, BF16), BF16)
    tl.store(win + (W - 2) * s_tap, x, mask=mask)
    y = _round(acc / (1.0 + tl.exp(-acc)), BF16)
    tl.store(out_ptr + b * D + d, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def conv_decode_qkv_kernel(xq, xk, xv, wq, wk, wv, winq, wink, winv, outq, outk, outv, slots_ptr, keep_ptr,
                           D, s_x, s_slot, s_d, s_tap, W: tl.constexpr, BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    slot = tl.load(slots_ptr + b)
    keep = tl.load(keep_ptr + b).to(tl.float32)
    _conv_row(xq, wq, winq, outq, b, slot, keep, d, mask, D, s_x, s_slot, s_d, s_tap, W, BF16, BLOCK_D)
    _conv_row(xk, wk, wink, outk, b, slot, keep, d, mask, D, s_x, s_slot, s_d, s_tap, W, BF16, BLOCK_D)
    _conv_row(xv, wv, winv, outv, b, slot, keep, d, mask, D, s_x, s_slot, s_d, s_tap, W, BF16, BLOCK_D)


def conv_decode_qkv_triton(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                           weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                           windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], slots: torch.Tensor,
                           keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as torch_ref.causal_conv_decode_torch (callers check conv_launch.accepts_decode)."""
    B, D = xs[0].shape
    W = weights[0].shape[1]
    # q/k/v usually arrive as column slices of one fused projection: read them in place when they share a
    # row stride (unit column stride), instead of copying each to a contiguous tensor.
    if any(x.stride(1) != 1 for x in xs) or len({x.stride(0) for x in xs}) != 1:
        xs = (xs[0].contiguous(), xs[1].contiguous(), xs[2].contiguous())
    xq, xk, xv = xs
    wq, wk, wv = (w.contiguous() for w in weights)
    out = torch.empty((3, B, D), dtype=xq.dtype, device=xq.device)
    block = min(MAX_BLOCK_D, max(32, triton.next_power_of_2(D)))
    grid = (B, triton.cdiv(D, block))
    conv_decode_qkv_kernel[grid](
        xq, xk, xv, wq, wk, wv, *windows, out[0], out[1], out[2], slots.contiguous(), keep.contiguous(),
        D, xq.stride(0), *windows[0].stride(), W=W, BF16=xq.dtype == torch.bfloat16, BLOCK_D=block,
        num_warps=4 if block >= 256 else 1,
        enable_fp_fusion=False,  # no mul+add -> fma contraction: fp32 products and sums round like torch's
    )
    return out[0], out[1], out[2]
