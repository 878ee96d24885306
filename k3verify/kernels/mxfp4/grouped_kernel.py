"""Triton grouped GEMM over MXFP4 experts: y[rows of e] = x[rows of e] @ decode(codes[e], scales[e])^T.

Rows of x arrive sorted by expert; `offs[e]` is the end of expert e's rows (torch._grouped_mm's
convention), so expert e owns rows offs[e-1]..offs[e]. Program (t, n) takes the t-th (expert, row
block) tile, found in-kernel from a prefix sum of each expert's tile count (no host sync, static grid:
CUDA-graph capturable), and BLOCK_N output columns. Its weights are read packed from HBM once per tile
and decoded in registers: E2M1 codes x 2^(E8M0 - 127), exact in bf16, into bf16 tensor-core dots with
fp32 accumulation. Each byte holds two codes, low nibble first, so the even input columns meet the low
nibbles and the odd columns the high nibbles: two dots, no interleave.

Imports triton at module level: load it lazily (kernels/mxfp4/triton_impl.py); for the CPU interpreter
set TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> fp32 values. Sign and
    magnitude bits placed at fp16 bits 15 and 11-9 make an fp16 equal to value * 2^-14 for every code
    (0.5 lands on an fp16 subnormal, which the conversion to fp32 keeps exactly)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e8m0(s):
    """E8M0 scale bytes (int32) -> 2^(s - 127) in fp32: s is exactly an fp32 biased exponent; s = 0 is the
    fp32 subnormal 2^-127, s = 255 gives inf like the torch reference's ldexp."""
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_grouped_mm_kernel(x_ptr, q_ptr, s_ptr, offs_ptr, y_ptr, N, K, E, s_xm, s_qe, s_qn, s_se, s_sn, s_ym,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    tile = tl.program_id(0)
    # which expert's which row block: tiles are numbered expert by expert, ceil(rows / BLOCK_M) each
    e = tl.arange(0, BLOCK_E)
    live = e < E
    ends = tl.load(offs_ptr + e, mask=live, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=live & (e > 0), other=0)
    tiles = tl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_end = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tiles_end <= tile).to(tl.int32), axis=0)
    if expert >= E:  # the grid is an upper bound on the tile count
        return
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), axis=0)
    rows = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.sum(tl.where(mine, ends, 0), axis=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N

    w_expert = expert.to(tl.int64)
    q_rows = q_ptr + w_expert * s_qe + cols.to(tl.int64)[:, None, None] * s_qn  # [BN, 1, 1]
    s_rows = s_ptr + w_expert * s_se + cols.to(tl.int64)[:, None] * s_sn  # [BN, 1]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * s_xm  # [BM, 1]
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    HALF: tl.constexpr = GROUP // 2  # bytes per scale group
    g = tl.arange(0, GROUPS)
    b = tl.arange(0, HALF)
    pair = tl.arange(0, BLOCK_K // 2)  # byte j of the block holds input columns 2j (low) and 2j + 1 (high)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP + g  # [G]
        g_ok = group < K // GROUP
        byte = group[:, None] * HALF + b[None, :]  # [G, HALF]
        q = tl.load(q_rows + byte[None, :, :], mask=col_ok[:, None, None] & g_ok[None, :, None], other=0)
        s = tl.load(s_rows + group[None, :], mask=col_ok[:, None] & g_ok[None, :], other=127)
        scale = _e8m0(s.to(tl.int32))[:, :, None]  # [BN, G, 1]
        q = q.to(tl.int32)
        lo = tl.reshape((_e2m1(q & 0xF) * scale).to(tl.bfloat16), (BLOCK_N, BLOCK_K // 2))
        hi = tl.reshape((_e2m1(q >> 4) * scale).to(tl.bfloat16), (BLOCK_N, BLOCK_K // 2))
        col = k0 + 2 * pair
        x_ok = row_ok[:, None] & (col < K)[None, :]
        x_even = tl.load(x_rows + col[None, :], mask=x_ok, other=0.0)
        x_odd = tl.load(x_rows + col[None, :] + 1, mask=x_ok, other=0.0)
        acc += tl.dot(x_even, tl.trans(lo))
        acc += tl.dot(x_odd, tl.trans(hi))
    out = y_ptr + rows.to(tl.int64)[:, None] * s_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
