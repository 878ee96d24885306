"""Triton tail of the grouped MoE combine (kernels/moe/grouped.py): each token's k expert outputs, read from where
the grouped GEMMs left them (rows sorted by expert), weighted and summed in route order, in one launch.

The torch tail it replaces ran three kernels over the [T*k, D] expert outputs: multiply by the route weights into fp32,
un-sort with index_copy_, and a sum over k, writing and re-reading an fp32 [T*k, D] tensor twice (a visible share of a
long prefill's MoE time). Here program (t, d) reads token t's k rows y[inv[t*k + j]] once, for one block of columns, and
writes only the fp32 [T, D] result. The sum runs j = 0..k-1 in route order, as the decode kernels' caller sums their
terms; a token's result depends on its own rows alone (no atomics, no batch-dependent order).

Imports triton at module level: load it lazily (kernels/moe/grouped.py); for the CPU interpreter set
TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_sorted_sum_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, D, stride_y, stride_out,
                          TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, cols] = sum_j w[t*k + j] * float(y[inv[t*k + j], cols]), j in route order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        row = tl.load(inv_ptr + pair).to(tl.int64)
        term = tl.load(y_ptr + row * stride_y + cols, mask=live, other=0.0).to(tl.float32) * tl.load(w_ptr + pair)
        acc = acc + term
    tl.store(out_ptr + t * stride_out + cols, acc, mask=live)
