"""Triton routed-expert combine for decode-sized batches: two launches per MoE layer, no sort.

A decode step routes a few rows to each expert it touches, so the two expert GEMMs are weight-streaming:
every byte of each touched expert is read once and multiplied by 1-16 rows. Program (e, n) finds the
(token, slot) pairs routed to expert e itself, by scanning the step's route ids (at most a few hundred),
and streams expert e's weight rows n*BLOCK_N.. once per 16 of those pairs; an expert nobody chose costs a
program that reads the ids and returns. No argsort, no row gather, no un-sort: rows are loaded from the
token they belong to and results stored at their pair index.

- `moe_gate_up_kernel`: a[pair] = glu(x[token] @ W1[e]^T, x[token] @ W3[e]^T) with the gate and up columns
  of one block computed side by side (w13 stacks W1 rows then W3 rows) and the GLU applied in registers.
- `moe_down_kernel`: terms[pair] = w[pair] * bf16(a[pair] @ W2[e]^T) in fp32 (deterministic: no atomics).
- `moe_finish_kernel`: each token's k terms summed in route order in fp32, and optionally rounded to the
  activation dtype and added to another [T, D] row (the shared expert's output), one launch for what took a
  reduction, a cast and an add.
- The compact grid (COMPACT): `moe_active_experts_kernel` first lists the experts the step touches, and the
  GEMM grids get one row per slot of that list (min(pairs, experts) rows) instead of one per expert, so a
  batch-1 step launches 8 rows of programs rather than 256 of which 248 return at once.

Rounding follows the reference's steps (kernels/moe/torch_ref.py): each GEMM output is rounded to the
activation dtype before the GLU and before the route weight, as F.linear's outputs are; only the GEMMs'
accumulation order differs. A pair's result depends on its own row alone (the K loop and its block size do
not change with the batch), so a request computes the same bits whatever shares its step.

Imports triton at module level: load it lazily (kernels/moe/decode_launch.py); for the CPU interpreter set
TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

SILU = tl.constexpr(0)  # silu(g) * u in the activation dtype
SITU = tl.constexpr(1)  # beta tanh(g / beta) sigmoid(g) * [lin tanh(u / lin)] in fp32


@triton.jit
def _routed(idx_ptr, M, expert, M_PAD: tl.constexpr):
    """The step's route ids [M] (flattened (token, slot) pairs) -> (which pairs chose `expert` [M_PAD],
    their rank among those pairs, how many did)."""
    p = tl.arange(0, M_PAD)
    hit = (tl.load(idx_ptr + p, mask=p < M, other=0) == expert) & (p < M)
    rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    return hit, rank, tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _block_pairs(hit, rank, count, block, M_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """The block-th BLOCK_M pairs routed to the expert, in pair order: (pair index [BLOCK_M], valid [BLOCK_M])."""
    r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    sel = hit[None, :] & (rank[None, :] == r[:, None])  # [BLOCK_M, M_PAD]: one column per valid row
    pairs = tl.sum(tl.where(sel, tl.arange(0, M_PAD)[None, :], 0), axis=1)
    return pairs, r < count


@triton.jit
def moe_active_experts_kernel(idx_ptr, list_ptr, M, E, SLOTS, M_PAD: tl.constexpr, E_PAD: tl.constexpr,
                              CHUNK: tl.constexpr):
    """One program: the experts the step's route ids [M] name, ascending, into list[0:count], -1 in
    list[count:SLOTS] (SLOTS = min(M, E)). The GEMM kernels' compact grid gives slot s to list[s]."""
    e = tl.arange(0, E_PAD)
    present = tl.zeros([E_PAD], dtype=tl.int32)
    for m0 in tl.static_range(0, M_PAD, CHUNK):
        p = m0 + tl.arange(0, CHUNK)
        ids = tl.load(idx_ptr + p, mask=p < M, other=-1)
        present = tl.maximum(present, tl.max((ids[None, :] == e[:, None]).to(tl.int32), axis=1))
    slot = tl.cumsum(present, axis=0) - 1
    count = tl.sum(present, axis=0)
    tl.store(list_ptr + slot, e, mask=(present == 1) & (e < E))
    tl.store(list_ptr + e, tl.full([E_PAD], -1, tl.int32), mask=(e >= count) & (e < SLOTS))


@triton.jit
def _expert_of(experts_ptr, COMPACT: tl.constexpr, COLS_FIRST: tl.constexpr):
    """This program's expert: its grid row (one per expert), or the list entry of its slot (-1: none). With
    COLS_FIRST the grid is (column blocks, experts): an expert's column blocks are launched one after another."""
    slot = tl.program_id(1) if COLS_FIRST else tl.program_id(0)
    if COMPACT:
        return tl.load(experts_ptr + slot)
    return slot


@triton.jit
def _col_block(COLS_FIRST: tl.constexpr):
    return tl.program_id(0) if COLS_FIRST else tl.program_id(1)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def moe_gate_up_kernel(x_ptr, idx_ptr, experts_ptr, w_ptr, a_ptr, M, TOP_K, I, K, s_xm, s_we, s_wn, s_am, beta,
                       lin_beta, ACT: tl.constexpr, HAS_LIN: tl.constexpr, COMPACT: tl.constexpr,
                       M_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       COLS_FIRST: tl.constexpr):
    expert = _expert_of(experts_ptr, COMPACT, COLS_FIRST)
    hit, rank, count = _routed(idx_ptr, M, expert, M_PAD)  # a slot without an expert (-1) matches no pair
    if count == 0:
        return
    cols = _col_block(COLS_FIRST) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    gate_rows = w_ptr + expert.to(tl.int64) * s_we + cols.to(tl.int64)[:, None] * s_wn  # [BN, 1]
    up_rows = gate_rows + I * s_wn
    kk = tl.arange(0, BLOCK_K)
    for block in range(0, tl.cdiv(count, BLOCK_M)):
        pairs, ok = _block_pairs(hit, rank, count, block, M_PAD, BLOCK_M)
        x_rows = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * s_xm  # [BM, 1]: the pair's token
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + kk) < K
            x = tl.load(x_rows + (k0 + kk)[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(gate_rows + (k0 + kk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(up_rows + (k0 + kk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = tl.dot(x, tl.trans(wg), acc_g)
            acc_u = tl.dot(x, tl.trans(wu), acc_u)
        dt = a_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)  # the GEMM outputs in the activation dtype, as F.linear returns them
        u = acc_u.to(dt).to(tl.float32)
        if ACT == SILU:
            a = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * u
        else:
            a = beta * _tanh(g / beta) * tl.sigmoid(g)
            if HAS_LIN:
                u = lin_beta * _tanh(u / lin_beta)
            a = a * u
        out = a_ptr + pairs.to(tl.int64)[:, None] * s_am + cols[None, :]
        tl.store(out, a.to(dt), mask=ok[:, None] & col_ok[None, :])


@triton.jit
def moe_down_kernel(a_ptr, idx_ptr, experts_ptr, rw_ptr, w_ptr, y_ptr, M, N, K, s_am, s_we, s_wn, s_ym,
                    COMPACT: tl.constexpr, M_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, COLS_FIRST: tl.constexpr):
    expert = _expert_of(experts_ptr, COMPACT, COLS_FIRST)
    hit, rank, count = _routed(idx_ptr, M, expert, M_PAD)
    if count == 0:
        return
    cols = _col_block(COLS_FIRST) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = w_ptr + expert.to(tl.int64) * s_we + cols.to(tl.int64)[:, None] * s_wn  # [BN, 1]
    kk = tl.arange(0, BLOCK_K)
    for block in range(0, tl.cdiv(count, BLOCK_M)):
        pairs, ok = _block_pairs(hit, rank, count, block, M_PAD, BLOCK_M)
        a_rows = a_ptr + pairs.to(tl.int64)[:, None] * s_am
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + kk) < K
            a = tl.load(a_rows + (k0 + kk)[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + (k0 + kk)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        route_w = tl.load(rw_ptr + pairs, mask=ok, other=0.0)
        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * route_w[:, None]
        out = y_ptr + pairs.to(tl.int64)[:, None] * s_ym + cols[None, :]
        tl.store(out, y, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def moe_finish_kernel(terms_ptr, add_ptr, out_ptr, D, K_ROUTE: tl.constexpr, HAS_ADD: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Program (token t, column block): acc = terms[t, 0] + terms[t, 1] + ... (route order, fp32); out = acc, or
    with HAS_ADD out = (acc rounded to add's dtype) + add[t] rounded to out's dtype (torch's y.to(dtype) + add)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    acc = tl.load(terms_ptr + (t * K_ROUTE) * D + cols, mask=ok, other=0.0)
    for j in tl.static_range(1, K_ROUTE):
        acc = acc + tl.load(terms_ptr + (t * K_ROUTE + j) * D + cols, mask=ok, other=0.0)
    if HAS_ADD:
        shared = tl.load(add_ptr + t * D + cols, mask=ok, other=0.0)
        acc = acc.to(shared.dtype).to(tl.float32) + shared.to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
