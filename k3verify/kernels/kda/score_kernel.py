"""Triton kernels of the KDA score: three for the unfused path (short convs, recording recurrence, gated
RMSNorm) and one that does all three in one launch. Launched by score_launch.py; imports triton at module
level (import it lazily; for the interpreter set TRITON_INTERPRET=1 before the first import).

Why the fused kernel equals the unfused ones bit for bit, by construction rather than by luck:
- every value is computed by the same @triton.jit helper in both (_conv_pos, _kda_step, _gated_norm);
- no reduction is left to tl.sum's layout-dependent order: _tree_sum adds adjacent pairs level by level in a
  fixed tree (reshape + split), so a sum has the same bits whatever register layout the compiler picks;
- what the unfused path rounds by storing to the activation dtype (conv outputs, o) the fused path rounds
  with _round_bf16, the same round-to-nearest-even the store performs;
- launches run with enable_fp_fusion=False: no mul+add is contracted into an fma in one and not the other.
Shapes: B rows (sequences), N = k+1 positions, H heads, DK = DV head dims, D = H * DK channels, W conv width.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the conv decode kernel's round-to-nearest-even: one definition, so both kernels round the same bits
from k3verify.kernels.conv.decode_kernel import _round

L2_EPS: tl.constexpr = tl.constexpr(1e-6)  # as kernels/kda/torch_ref.L2_EPS


@triton.jit
def _tree_sum(x, LOG2: tl.constexpr):
    """Sum of a [2**LOG2] vector in a fixed pairwise tree ((x0 + x1) + (x2 + x3)) + ...: same bits in any layout."""
    for _ in tl.static_range(LOG2):
        a, b = tl.split(tl.reshape(x, [x.shape[0] // 2, 2]))
        x = a + b
    return tl.sum(x, axis=0)  # one element left: exact


@triton.jit
def _tree_sum_rows(x, LOG2: tl.constexpr):
    """Row sums of [M, 2**LOG2] in the same fixed pairwise tree as _tree_sum -> [M]."""
    for _ in tl.static_range(LOG2):
        a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        x = a + b
    return tl.sum(x, axis=1)


@triton.jit
def _conv_tap(x_ptr, win_ptr, b, slot, keep, d, mask, s_x, s_slot, s_d, s_tap, C, N: tl.constexpr, W: tl.constexpr,
              BF16: tl.constexpr):
    """Entry C of [pool window (W-1 taps) | x of positions 0..N-1] for channels d, in fp32 (x rows s_x apart)."""
    from_win = (tl.zeros_like(d) + C) < W - 1  # a vector mask (C is a runtime scalar)
    win = tl.load(win_ptr + slot * s_slot + d * s_d + C * s_tap, mask=mask & from_win, other=0.0)
    x = tl.load(x_ptr + (b * N + C - (W - 1)) * s_x + d, mask=mask & ~from_win, other=0.0).to(tl.float32)
    return tl.where(from_win, _round(win, BF16) * keep, x)


@triton.jit
def _conv_pos(x_ptr, w_ptr, win_ptr, rec_ptr, b, slot, keep, d, mask, rec_mask, D, s_x, s_slot, s_d, s_tap,
              CONV: tl.constexpr, J, N: tl.constexpr, W: tl.constexpr, BF16: tl.constexpr):
    """silu(conv) at position J for channels d (rounded as the activation dtype), and conv CONV's window after J
    stored to rec[b, J, CONV, d, :] where rec_mask. Op order of kernels/conv: acc = round(acc + round(tap * w)),
    oldest first. The window after J is taps J+1 .. J+W-1 of this position's own conv: stored as they are loaded."""
    acc = tl.zeros(d.shape, dtype=tl.float32)
    rec = rec_ptr + (((b * N + J) * 3 + CONV) * D + d) * (W - 1)
    for t in tl.static_range(W):
        tap = _conv_tap(x_ptr, win_ptr, b, slot, keep, d, mask, s_x, s_slot, s_d, s_tap, J + t, N, W, BF16)
        if t > 0:
            tl.store(rec + (t - 1), tap, mask=rec_mask)
        w = tl.load(w_ptr + d * W + t, mask=mask, other=0.0).to(tl.float32)
        acc = _round(acc + _round(tap * w, BF16), BF16)
    return _round(acc / (1.0 + tl.exp(-acc)), BF16)


@triton.jit
def _kda_step(S, q, k, v, g, beta, scale, LOG2K: tl.constexpr):
    """One delta-rule step on the transposed state S [BV, BK] (S[v, i] = state[i, v]); q, k, g [BK], v [BV]
    fp32, beta a scalar. Same math as kernels/kda/torch_ref.kda_decode_torch. Returns (S, o [BV])."""
    # one correctly rounded reciprocal per vector (a per-element div.rn is a ptxas subroutine call)
    qn = q * tl.math.div_rn(1.0, tl.sqrt_rn(_tree_sum(q * q, LOG2K) + L2_EPS)) * scale
    kn = k * tl.math.div_rn(1.0, tl.sqrt_rn(_tree_sum(k * k, LOG2K) + L2_EPS))
    S = S * tl.exp(g)[None, :]
    pred = _tree_sum_rows(S * kn[None, :], LOG2K)
    delta = beta * (v - pred)
    S = S + kn[None, :] * delta[:, None]
    return S, _tree_sum_rows(S * qn[None, :], LOG2K)


@triton.jit
def _gated_norm(x, gate, w, eps, DV, LOG2V: tl.constexpr):
    """(x * rsqrt(mean(x^2) + eps)) * w * sigmoid(gate), fp32 (kernels/norm/torch_ref.gated_rms_norm_torch)."""
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(_tree_sum(x * x, LOG2V) / DV + eps))
    return x * rstd * w * (1.0 / (1.0 + tl.exp(-gate)))


@triton.jit
def spec_conv_kernel(xq, xk, xv, wq, wk, wv, winq, wink, winv, outq, outk, outv, rec_ptr, slots_ptr, keep_ptr,
                     D, s_x, s_slot, s_d, s_tap, N: tl.constexpr, W: tl.constexpr, BF16: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Program (row b, channel block): the three convs at every position (inputs' rows s_x apart: column slices
    of the fused projection GEMM); outputs [B*N, D], records."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep = tl.load(keep_ptr + b).to(tl.float32)
    for j in range(N):  # a runtime loop: one body to compile, not N
        out = (b * N + j) * D + d
        y = _conv_pos(xq, wq, winq, rec_ptr, b, slot, keep, d, mask, mask, D, s_x, s_slot, s_d, s_tap, 0, j, N, W, BF16)
        tl.store(outq + out, y.to(outq.dtype.element_ty), mask=mask)
        y = _conv_pos(xk, wk, wink, rec_ptr, b, slot, keep, d, mask, mask, D, s_x, s_slot, s_d, s_tap, 1, j, N, W, BF16)
        tl.store(outk + out, y.to(outk.dtype.element_ty), mask=mask)
        y = _conv_pos(xv, wv, winv, rec_ptr, b, slot, keep, d, mask, mask, D, s_x, s_slot, s_d, s_tap, 2, j, N, W, BF16)
        tl.store(outv + out, y.to(outv.dtype.element_ty), mask=mask)


@triton.jit
def _state_offsets(b, h, H, DK, DV, J, N: tl.constexpr, i, v):
    """Offsets of record (b, J, head h) laid out [B, N, H, DK, DV], transposed to [BV, BK]."""
    return (((b * N + J) * H + h) * DK + i[None, :]).to(tl.int64) * DV + v[:, None]


@triton.jit
def _step_and_record(S, q, k, v, g_ptr, beta_ptr, rec_ptr, o_ptr, scale, b, h, H, DK, DV, j, i, vv, mi, mv, m2,
                     N: tl.constexpr, LOG2K: tl.constexpr, BF16: tl.constexpr):
    """Position j's step from its q, k [BK] and v [BV] (fp32), its record and its o; returns the state after it.
    Both recording kernels end a position here."""
    t = b * N + j
    g = tl.load(g_ptr + (t * H + h) * DK + i, mask=mi, other=0.0)
    beta = tl.load(beta_ptr + t * H + h)
    S, o = _kda_step(S, q, k, v, g, beta, scale, LOG2K)
    tl.store(rec_ptr + _state_offsets(b, h, H, DK, DV, j, N, i, vv), S, mask=m2)
    tl.store(o_ptr + (t * H + h) * DV + vv, _round(o, BF16).to(o_ptr.dtype.element_ty), mask=mv)
    return S


@triton.jit
def _record_position(S, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rec_ptr, o_ptr, scale, b, h, H, DK, DV, j, i, vv, mi,
                     mv, m2, N: tl.constexpr, LOG2K: tl.constexpr, BF16: tl.constexpr):
    """Position j of kda_record_kernel's program: q, k, v loaded, then _step_and_record."""
    t = b * N + j
    q = tl.load(q_ptr + (t * H + h) * DK + i, mask=mi, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + (t * H + h) * DK + i, mask=mi, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (t * H + h) * DV + vv, mask=mv, other=0.0).to(tl.float32)
    return _step_and_record(S, q, k, v, g_ptr, beta_ptr, rec_ptr, o_ptr, scale, b, h, H, DK, DV, j, i, vv, mi, mv, m2,
                            N, LOG2K, BF16)


@triton.jit
def kda_record_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, rec_ptr, o_ptr, scale, H, DK, DV,
                      N: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LOG2K: tl.constexpr, BF16: tl.constexpr,
                      UNROLL: tl.constexpr = False):
    """Program (row b, head h, value block): the recurrence over N positions on a [BV, BK] block of the pool state
    (read only); records and o for its BV value columns. UNROLL: the positions unrolled at compile time (the
    positions' loads free to start before the earlier steps finish), else one loop body; the same code either way."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i, vv = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mi, mv = i < DK, vv < DV
    m2 = mv[:, None] & mi[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    S = tl.load(state_ptr + ((slot * H + h) * DK + i[None, :]) * DV + vv[:, None], mask=m2, other=0.0)
    if UNROLL:
        for j in tl.static_range(N):
            S = _record_position(S, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rec_ptr, o_ptr, scale, b, h, H, DK, DV, j, i,
                                 vv, mi, mv, m2, N, LOG2K, BF16)
    else:
        for j in range(N):  # a runtime loop: one body to compile, not N
            S = _record_position(S, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rec_ptr, o_ptr, scale, b, h, H, DK, DV, j, i,
                                 vv, mi, mv, m2, N, LOG2K, BF16)


@triton.jit
def gated_norm_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, eps, DV, BV: tl.constexpr, LOG2V: tl.constexpr,
                      BF16: tl.constexpr):
    """Program per (token, head) row of DV: y = _gated_norm, rounded to the activation dtype."""
    row = tl.program_id(0).to(tl.int64)
    vv = tl.arange(0, BV)
    mv = vv < DV
    x = tl.load(x_ptr + row * DV + vv, mask=mv, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * DV + vv, mask=mv, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + vv, mask=mv, other=0.0).to(tl.float32)
    y = _gated_norm(x, gate, w, eps, DV, LOG2V)
    tl.store(y_ptr + row * DV + vv, _round(y, BF16).to(y_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _fused_position(S, xq, xk, xv, wq, wk, wv, winq, wink, winv, s_x, s_slot, s_d, s_tap, g_ptr, beta_ptr, conv_rec,
                    state_rec, o_ptr, scale, b, h, H, D, DK, DV, slot, keep, first, j, i, vv, mi, mv, m2,
                    N: tl.constexpr, W: tl.constexpr, LOG2K: tl.constexpr, BF16: tl.constexpr):
    """Position j of kda_score_fused_kernel's program: its convs (q/k windows recorded by value block 0 only), then
    _step_and_record."""
    q = _conv_pos(xq, wq, winq, conv_rec, b, slot, keep, h * DK + i, mi, mi & first, D, s_x, s_slot, s_d, s_tap, 0,
                  j, N, W, BF16)
    k = _conv_pos(xk, wk, wink, conv_rec, b, slot, keep, h * DK + i, mi, mi & first, D, s_x, s_slot, s_d, s_tap, 1,
                  j, N, W, BF16)
    v = _conv_pos(xv, wv, winv, conv_rec, b, slot, keep, h * DV + vv, mv, mv, D, s_x, s_slot, s_d, s_tap, 2, j,
                  N, W, BF16)
    return _step_and_record(S, q, k, v, g_ptr, beta_ptr, state_rec, o_ptr, scale, b, h, H, DK, DV, j, i, vv, mi, mv,
                            m2, N, LOG2K, BF16)


@triton.jit
def kda_score_fused_kernel(xq, xk, xv, wq, wk, wv, winq, wink, winv, s_x, s_slot, s_d, s_tap, slots_ptr, keep_ptr,
                            state_ptr, g_ptr, beta_ptr, gate_ptr, nw_ptr, conv_rec, state_rec, o_ptr, y_ptr,
                            counter_ptr, scale, eps, H, DK, DV, N: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, NVB: tl.constexpr, BVF: tl.constexpr, LOG2K: tl.constexpr,
                            LOG2V: tl.constexpr, BF16: tl.constexpr, UNROLL: tl.constexpr = False):
    """Program (row b, head h, value block): per position the head's q/k conv channels and the block's v channels,
    the recurrence step on a [BV, BK] state block, records and o; then the last of the head's NVB programs to
    finish (a counter it resets) applies the gated norm to the head's whole o rows. The pool is only read.
    UNROLL: the positions unrolled at compile time (as kda_record_kernel's)."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i, vv = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mi, mv = i < DK, vv < DV
    m2 = mv[:, None] & mi[None, :]
    D = H * DK
    first = (tl.zeros([BK], dtype=tl.int32) + vb) == 0  # q/k windows are recorded once per head (a vector mask)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep = tl.load(keep_ptr + b).to(tl.float32)
    S = tl.load(state_ptr + ((slot * H + h) * DK + i[None, :]) * DV + vv[:, None], mask=m2, other=0.0)
    if UNROLL:
        for j in tl.static_range(N):
            S = _fused_position(S, xq, xk, xv, wq, wk, wv, winq, wink, winv, s_x, s_slot, s_d, s_tap, g_ptr, beta_ptr,
                                conv_rec, state_rec, o_ptr, scale, b, h, H, D, DK, DV, slot, keep, first, j, i, vv, mi,
                                mv, m2, N, W, LOG2K, BF16)
    else:
        for j in range(N):  # a runtime loop: one body to compile, not N
            S = _fused_position(S, xq, xk, xv, wq, wk, wv, winq, wink, winv, s_x, s_slot, s_d, s_tap, g_ptr, beta_ptr,
                                conv_rec, state_rec, o_ptr, scale, b, h, H, D, DK, DV, slot, keep, first, j, i, vv, mi,
                                mv, m2, N, W, LOG2K, BF16)
    # every thread's o stores, then one acq_rel ticket: the program that draws the last one sees all NVB blocks
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr + b * H + h, 1, sem="acq_rel", scope="gpu")
    if ticket == NVB - 1:
        tl.atomic_xchg(counter_ptr + b * H + h, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        vf = tl.arange(0, BVF)
        mf = vf < DV
        w_norm = tl.load(nw_ptr + vf, mask=mf, other=0.0).to(tl.float32)
        for jn in range(N):  # a runtime loop (named apart from the positions' j, a constexpr when unrolled)
            row = (b * N + jn) * H + h
            # .cg: read through L2, where the other programs' o stores landed (never a stale L1 line)
            x = tl.load(o_ptr + row * DV + vf, mask=mf, other=0.0, cache_modifier=".cg").to(tl.float32)
            gate = tl.load(gate_ptr + row * DV + vf, mask=mf, other=0.0).to(tl.float32)
            y = _gated_norm(x, gate, w_norm, eps, DV, LOG2V)
            tl.store(y_ptr + row * DV + vf, _round(y, BF16).to(y_ptr.dtype.element_ty), mask=mf)
