"""Triton prefill of the q/k/v short convs over a packed token stream: two launches for all three convs.

`conv_tokens_kernel`, program (token block, channel block): each token's taps come from its own sequence's
earlier tokens, or from that sequence's initial window (a continuation) or zeros (a fresh sequence) where the
tap reaches before its first token in the pack; silu(conv) out. `conv_final_windows_kernel`, program
(sequence, channel block): each sequence's last W-1 inputs (reaching into its initial window when it is
shorter than that) become its final window. The arithmetic is the decode kernel's (decode_kernel._round:
fp32 math rounded to the activation dtype after every multiply and add, taps oldest first), which is what
torch_ref.causal_conv_varlen_torch computes with torch's elementwise ops; only silu's exp / division may
differ from torch by an ulp.

Imports triton at module level: import it lazily (kernels/conv/conv_launch.py), and for the interpreter set
TRITON_INTERPRET=1 before this module is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3verify.kernels.conv.decode_kernel import _round

BLOCK_T = 16
MAX_BLOCK_D = 256


@triton.jit
def _conv_tokens(x_ptr, w_ptr, init_ptr, out_ptr, t, n, pos, tmask, d, dmask, D, s_x, s_in, s_id, s_it,
                 HAS_INIT: tl.constexpr, W: tl.constexpr, BF16: tl.constexpr):
    """One conv over a [BLOCK_T, BLOCK_D] tile: t / n / pos [BLOCK_T, 1] (token, its sequence, its offset in
    the sequence), d [1, BLOCK_D]."""
    m = tmask & dmask
    acc = tl.zeros(m.shape, dtype=tl.float32)
    for j in tl.static_range(W):
        shift = W - 1 - j
        inside = pos >= shift  # the tap is a token of this pack
        tap = tl.load(x_ptr + (t - shift) * s_x + d, mask=m & inside, other=0.0).to(tl.float32)
        if HAS_INIT:  # else the tap before the sequence's first token is the zero row
            old = tl.load(init_ptr + n * s_in + d * s_id + (W - 1 + pos - shift) * s_it, mask=m & (pos < shift),
                          other=0.0).to(tl.float32)
            tap = tl.where(inside, tap, old)
        w = tl.load(w_ptr + d * W + j, mask=dmask, other=0.0).to(tl.float32)
        acc = _round(acc + _round(tap * w, BF16), BF16)
    y = _round(acc / (1.0 + tl.exp(-acc)), BF16)
    tl.store(out_ptr + t * D + d, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def conv_tokens_kernel(xq, xk, xv, wq, wk, wv, iq, ik, iv, oq, ok, ov, seg_ptr, pos_ptr, T, D, s_x, s_in, s_id, s_it,
                       HAS_INIT: tl.constexpr, W: tl.constexpr, BF16: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    # int64 token index: (t - shift) * s_x passes 2^31 for long packs (a fused projection row is ~3 x kda_dim wide)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    tmask, dmask = t < T, d < D
    n = tl.load(seg_ptr + t, mask=tmask, other=0)
    pos = tl.load(pos_ptr + t, mask=tmask, other=0)
    _conv_tokens(xq, wq, iq, oq, t, n, pos, tmask, d, dmask, D, s_x, s_in, s_id, s_it, HAS_INIT, W, BF16)
    _conv_tokens(xk, wk, ik, ok, t, n, pos, tmask, d, dmask, D, s_x, s_in, s_id, s_it, HAS_INIT, W, BF16)
    _conv_tokens(xv, wv, iv, ov, t, n, pos, tmask, d, dmask, D, s_x, s_in, s_id, s_it, HAS_INIT, W, BF16)


@triton.jit
def _final_window(x_ptr, init_ptr, fin_ptr, seq, start, length, d, dmask, s_x, s_in, s_id, s_it, D,
                  HAS_INIT: tl.constexpr, W: tl.constexpr):
    """Window slot j of sequence `seq` = its input at offset length - (W-1) + j (its initial window's tail when
    negative). fin is [N, D, W-1] contiguous."""
    for j in tl.static_range(W - 1):
        rel = tl.zeros_like(d) + (length - (W - 1) + j)  # a [BLOCK_D] tensor: masks stay tensors
        val = tl.load(x_ptr + (start + rel) * s_x + d, mask=dmask & (rel >= 0), other=0.0)
        if HAS_INIT:
            old = tl.load(init_ptr + seq * s_in + d * s_id + (W - 1 + rel) * s_it, mask=dmask & (rel < 0),
                          other=0.0)
            val = tl.where(rel >= 0, val, old)
        tl.store(fin_ptr + seq * D * (W - 1) + d * (W - 1) + j, val.to(fin_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def conv_final_windows_kernel(xq, xk, xv, iq, ik, iv, fq, fk, fv, cu_ptr, D, s_x, s_in, s_id, s_it,
                              HAS_INIT: tl.constexpr, W: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    start = tl.load(cu_ptr + seq)
    length = tl.load(cu_ptr + seq + 1) - start
    _final_window(xq, iq, fq, seq, start, length, d, dmask, s_x, s_in, s_id, s_it, D, HAS_INIT, W)
    _final_window(xk, ik, fk, seq, start, length, d, dmask, s_x, s_in, s_id, s_it, D, HAS_INIT, W)
    _final_window(xv, iv, fv, seq, start, length, d, dmask, s_x, s_in, s_id, s_it, D, HAS_INIT, W)


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def causal_conv_qkv_triton(xs: QKV, weights: QKV, seg_ids: torch.Tensor, local_pos: torch.Tensor,
                           cu_seqlens: torch.Tensor, initial: QKV | None) -> tuple[QKV, QKV]:
    """Same contract as torch_ref.causal_conv_qkv_torch (callers check conv_launch.accepts_prefill)."""
    T, D = xs[0].shape
    W = weights[0].shape[1]
    N = cu_seqlens.numel() - 1
    # q/k/v usually arrive as column slices of one fused projection: read them in place when they share a
    # row stride (unit column stride), instead of copying each to a contiguous tensor.
    if any(x.stride(1) != 1 for x in xs) or len({x.stride(0) for x in xs}) != 1:
        xs = (xs[0].contiguous(), xs[1].contiguous(), xs[2].contiguous())
    wq, wk, wv = (w.contiguous() for w in weights)
    dev, dtype = xs[0].device, xs[0].dtype
    out = torch.empty((3, T, D), dtype=dtype, device=dev)
    fin = torch.empty((3, N, D, W - 1), dtype=dtype, device=dev)
    has_init = initial is not None
    inits = initial if initial is not None else (out, out, out)  # never read without HAS_INIT
    if has_init and len({t.stride() for t in inits}) != 1:  # the kernel shares one set of strides
        inits = (inits[0].contiguous(), inits[1].contiguous(), inits[2].contiguous())
    s_in, s_id, s_it = inits[0].stride() if has_init else (0, 0, 0)
    block_d = min(MAX_BLOCK_D, max(32, triton.next_power_of_2(D)))
    bf16 = dtype == torch.bfloat16
    common = dict(HAS_INIT=has_init, W=W, enable_fp_fusion=False)  # no fma contraction: products round like torch's
    conv_tokens_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(D, block_d))](
        *xs, wq, wk, wv, *inits, out[0], out[1], out[2], seg_ids, local_pos, T, D, xs[0].stride(0), s_in, s_id,
        s_it, BF16=bf16, BLOCK_T=BLOCK_T, BLOCK_D=block_d, num_warps=4, **common)
    conv_final_windows_kernel[(N, triton.cdiv(D, block_d))](
        *xs, *inits, fin[0], fin[1], fin[2], cu_seqlens, D, xs[0].stride(0), s_in, s_id, s_it, BLOCK_D=block_d,
        num_warps=4 if block_d >= 256 else 1, **common)
    return (out[0], out[1], out[2]), (fin[0], fin[1], fin[2])
