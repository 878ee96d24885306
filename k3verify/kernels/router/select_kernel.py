"""The Triton kernel behind kernels/router/select_launch.py: one program per token row, fp32 throughout.

Imported lazily (select_launch._kernels) so that importing k3verify never needs triton. The row's E
experts sit in one power-of-two block padded with -inf; top-k is k rounds of "max, the lowest index
among equal maxima, take it"; the taken ids are then emitted smallest first, so the output is ascending
without a sort.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_select_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, E, scaling, TOP_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Row r: s = sigmoid(logits[r]); ids = top-k of s + bias, ascending; w = s[ids] (/ (sum + 1e-20)) * scaling."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    logit = tl.load(logits_ptr + row * E + cols, mask=valid, other=0.0)
    bias = tl.load(bias_ptr + cols, mask=valid, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-logit))
    choice = s + bias
    # NaN scores (only a garbage row can have them: the scratch slot's padded decode rows) rank as -inf,
    # so every row still takes TOP_K in-range experts; torch would rank NaN first. Never out of range.
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))
    taken = tl.zeros([BLOCK_E], dtype=tl.int32)  # 1 = chosen; chosen ids leave the race even at -inf
    for _ in tl.static_range(TOP_K):
        free = valid & (taken == 0)
        best = tl.max(tl.where(free, choice, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (choice == best), cols, BLOCK_E), axis=0)
        taken = tl.where(cols == pick, 1, taken)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        low = tl.min(tl.where(taken == 1, cols, BLOCK_E), axis=0)
        at = cols == low
        ids = tl.where(slots == j, tl.minimum(low, E - 1), ids)
        w = tl.where(slots == j, tl.sum(tl.where(at, s, 0.0), axis=0), w)
        taken = tl.where(at, 2, taken)  # 2 = emitted
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    out = row * TOP_K + slots
    keep = slots < TOP_K
    tl.store(w_ptr + out, w * scaling, mask=keep)
    tl.store(idx_ptr + out, ids.to(tl.int64), mask=keep)
