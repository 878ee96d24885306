"""Triton grouped GEMM over MXFP4 experts: y[rows of e] = x[rows of e] @ decode(codes[e], scales[e])^T.

Rows of x arrive sorted by expert; `offs[e]` is the end of expert e's rows (torch._grouped_mm's convention),
so expert e owns rows offs[e-1]..offs[e]. A program takes the t-th (expert, row block) tile, found in-kernel
from a prefix sum of each expert's tile count (no host sync, static grid: CUDA-graph capturable), and one
block of BLOCK_N output columns; programs walk GROUP_T tiles across all column blocks. Its weights are read
packed from HBM once per tile and decoded in registers: E2M1 codes x 2^(E8M0 - 127), exact in bf16,
interleaved back into input-column order (each byte holds two codes, low nibble first) for one bf16
tensor-core dot per K block with fp32 accumulation.

Imports triton at module level: load it lazily (kernels/mxfp4/grouped_launch.py); for the CPU interpreter set
TRITON_INTERPRET=1 before this module is first imported.
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
def _tile_of(pid, num_tiles, num_n, GROUP_T: tl.constexpr):
    """Program -> (row tile, column block), GROUP_T row tiles at a time across every column block: the
    activations of those tiles stay in L2 while the expert's weights stream past once per group."""
    per_group = GROUP_T * num_n
    first = (pid // per_group) * GROUP_T
    size = tl.minimum(num_tiles - first, GROUP_T)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def mxfp4_grouped_mm_kernel(x_ptr, q_ptr, s_ptr, offs_ptr, y_ptr, N, K, E, num_tiles, s_xm, s_qe, s_qn, s_se, s_sn,
                            s_ym, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_T: tl.constexpr):
    tile, n_block = _tile_of(tl.program_id(0), num_tiles, tl.cdiv(N, BLOCK_N), GROUP_T)
    # which expert's which row block: tiles are numbered expert by expert, ceil(rows / BLOCK_M) each
    e = tl.arange(0, BLOCK_E)
    live = e < E
    ends = tl.load(offs_ptr + e, mask=live, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=live & (e > 0), other=0)
    tiles = tl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tiles_end = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tiles_end <= tile).to(tl.int32), axis=0)
    if expert >= E:  # num_tiles is an upper bound on the tile count
        return
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), axis=0)
    rows = tl.sum(tl.where(mine, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.sum(tl.where(mine, ends, 0), axis=0)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N

    w_expert = expert.to(tl.int64)
    q_rows = q_ptr + w_expert * s_qe + cols.to(tl.int64)[:, None, None] * s_qn  # [BN, 1, 1]
    s_rows = s_ptr + w_expert * s_se + cols.to(tl.int64)[:, None] * s_sn  # [BN, 1]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * s_xm  # [BM, 1]
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    HALF: tl.constexpr = GROUP // 2  # bytes per scale group
    g = tl.arange(0, GROUPS)
    b = tl.arange(0, HALF)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group = k0 // GROUP + g  # [G]
        g_ok = group < K // GROUP
        byte = group[:, None] * HALF + b[None, :]  # [G, HALF]
        q = tl.load(q_rows + byte[None, :, :], mask=col_ok[:, None, None] & g_ok[None, :, None], other=0)
        s = tl.load(s_rows + group[None, :], mask=col_ok[:, None] & g_ok[None, :], other=127)
        scale = _e8m0(s.to(tl.int32))[:, :, None]  # [BN, G, 1]
        q = q.to(tl.int32)
        lo = _e2m1(q & 0xF) * scale  # input column 2j of byte j
        hi = _e2m1(q >> 4) * scale  # input column 2j + 1
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)).to(tl.bfloat16)  # exact: <= 2 significant bits
        x = tl.load(x_rows + (k0 + kk)[None, :], mask=row_ok[:, None] & (k0 + kk < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = y_ptr + rows.to(tl.int64)[:, None] * s_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
