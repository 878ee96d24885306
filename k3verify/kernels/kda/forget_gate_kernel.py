"""Triton kernel of the KDA forget gate and beta (kernels/kda/torch_ref.kda_forget_gate / kda_beta) in one launch.

torch makes them in six: bf16 + fp32 add, softplus, negation, multiply (or the safe gate's multiply, sigmoid,
multiply), beta's cast and sigmoid. Program (token t, channel block): g[t, block] from f_b_proj's output and
dt_bias with the head's decay rate A = exp(A_log); block 0 also makes beta[t, :]. The math is torch's op for op
in fp32; exp and log are Triton's (a few ulps off torch's libm), softplus fla's form (x past 20 passes through).

Imports triton at module level: import it lazily (kernels/kda/forget_gate_launch.py); for the interpreter set
TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

SOFTPLUS_THRESHOLD: tl.constexpr = tl.constexpr(20.0)  # torch's F.softplus default


@triton.jit
def _sigmoid(x):
    return tl.math.div_rn(1.0, 1.0 + tl.exp(-x))


@triton.jit
def kda_forget_gate_beta_kernel(f_ptr, dt_ptr, a_ptr, b_ptr, g_ptr, beta_ptr, lower_bound, s_f, s_b, D, DK, H,
                         SAFE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """f [T, D] (row stride s_f), dt_bias [D] fp32, A [H] fp32, b [T, H] (row stride s_b) -> g [T, D] fp32 (plain:
    -A softplus(f + dt_bias); SAFE: lower_bound sigmoid(A (f + dt_bias))), beta [T, H] fp32 = sigmoid(b)."""
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    d = blk * BLOCK + tl.arange(0, BLOCK)
    m = d < D
    raw = tl.load(f_ptr + t * s_f + d, mask=m, other=0.0).to(tl.float32) + tl.load(dt_ptr + d, mask=m, other=0.0)
    A = tl.load(a_ptr + d // DK, mask=m, other=0.0)
    if SAFE:
        g = lower_bound * _sigmoid(A * raw)
    else:
        softplus = tl.where(raw > SOFTPLUS_THRESHOLD, raw, tl.log(1.0 + tl.exp(raw)))
        g = -A * softplus
    tl.store(g_ptr + t * D + d, g, mask=m)
    if blk == 0:
        hh = tl.arange(0, BLOCK_H)
        mh = hh < H
        b = tl.load(b_ptr + t * s_b + hh, mask=mh, other=0.0).to(tl.float32)
        tl.store(beta_ptr + t * H + hh, _sigmoid(b), mask=mh)
