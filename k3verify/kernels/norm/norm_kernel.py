"""The Triton kernels behind kernels/norm/norm_launch.py: one program per row, fp32 math.

Imported lazily (norm_launch._kernels) so that importing k3verify never needs triton. Each kernel
makes two passes over its row in BLOCK-wide chunks: the sum of squares, then normalize and store;
when the row fits one BLOCK the second pass re-reads it from cache.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, x_row_stride, y_row_stride, W, eps, BLOCK: tl.constexpr):
    """y = w * (x * rstd).to(x.dtype), rounded to y's dtype; rstd = 1 / sqrt(mean(x^2) + eps) in fp32."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, W, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < W, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / W + eps)
    for start in range(0, W, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < W
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # the torch reference casts the normalized row to x's dtype before the weight multiply
        normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_row + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_fwd_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, x_row_stride, r_row_stride, s_row_stride,
                            y_row_stride, W, eps, BLOCK: tl.constexpr):
    """s = (x + r) rounded to s's dtype, stored; then rms_norm_fwd_kernel's arithmetic on the rounded s (y)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    r_row = r_ptr + row * r_row_stride
    s_row = s_ptr + row * s_row_stride
    y_row = y_ptr + row * y_row_stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, W, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < W
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(s_ptr.dtype.element_ty)
        tl.store(s_row + cols, s, mask=mask)
        s32 = s.to(tl.float32)
        acc += s32 * s32
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / W + eps)
    for start in range(0, W, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < W
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
        s32 = (x + r).to(s_ptr.dtype.element_ty).to(tl.float32)  # the stored s, recomputed (no read-after-write)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (s32 * rstd).to(s_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_row + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_rms_norm_fwd_kernel(x_ptr, g_ptr, w_ptr, y_ptr, x_row_stride, g_row_stride, y_row_stride, W, eps,
                              BLOCK: tl.constexpr):
    """y = (x * rstd * w * sigmoid(g)).to(y's dtype), all in fp32 with one cast at the end."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    g_row = g_ptr + row * g_row_stride
    y_row = y_ptr + row * y_row_stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, W, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < W, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / W + eps)
    for start in range(0, W, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < W
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = x * rstd * w * (1.0 / (1.0 + tl.exp(-g)))
        tl.store(y_row + cols, out.to(y_ptr.dtype.element_ty), mask=mask)
