"""Depthwise causal conv (width W) + SiLU over a packed token stream, in plain torch.

Every sequence starts from its own window of W-1 previous inputs (zeros for a fresh sequence, the
cached window for a continuation or a decode step), so nothing leaks across sequence boundaries.
Implemented as a gather over [x | initial windows | zero row] so one code path serves prefill
(many tokens per sequence) and decode (one token per sequence).
"""

from __future__ import annotations

import torch


def _sources(seg_ids: torch.Tensor, local_pos: torch.Tensor, shift: int, total: int, width: int,
             has_initial: bool, zero_row: int) -> torch.Tensor:
    """Row of the gather buffer holding x[t - shift] of each token's own sequence."""
    inside = local_pos >= shift
    own = torch.arange(seg_ids.numel(), device=seg_ids.device) - shift
    if has_initial:
        window = total + seg_ids * (width - 1) + (width - 1) + local_pos - shift
    else:
        window = torch.full_like(own, zero_row)
    return torch.where(inside, own, window)


def causal_conv_varlen_torch(x: torch.Tensor, weight: torch.Tensor, seg_ids: torch.Tensor, local_pos: torch.Tensor,
                             cu_seqlens: torch.Tensor, initial: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D]; weight [D, W] in x's dtype; seg_ids / local_pos [T] (sequence of each token, offset
    from that sequence's first token in this call); cu_seqlens [N+1]; initial [N, D, W-1] or None
    (zeros). Returns (silu(conv(x)) [T, D] in x's dtype, final windows [N, D, W-1] in x's dtype)."""
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.numel() - 1
    parts = [x]
    if initial is not None:
        parts.append(initial.to(x.dtype).permute(0, 2, 1).reshape(N * (W - 1), D))
    parts.append(x.new_zeros(1, D))
    buf = torch.cat(parts)
    zero_row = buf.shape[0] - 1
    has_init = initial is not None
    # Taps accumulate in the activation dtype, oldest first, like the eager reference (oracle); an fp32
    # accumulator is closer to fp64 but differs from it by a few bf16 ulps, which the bf16 gate counts.
    acc = torch.zeros(T, D, dtype=x.dtype, device=x.device)
    for tap in range(W):
        src = _sources(seg_ids, local_pos, W - 1 - tap, T, W, has_init, zero_row)
        acc = acc + buf[src] * weight[:, tap]
    y = torch.nn.functional.silu(acc)
    # final window j of sequence n is its input at (len_n - (W-1) + j), reaching into the old window
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    j = torch.arange(W - 1, device=x.device)
    rel = lens[:, None] - (W - 1) + j[None, :]  # [N, W-1]
    own = cu_seqlens[:-1, None] + rel
    seq = torch.arange(N, device=x.device)[:, None]
    if has_init:
        old = T + seq * (W - 1) + (W - 1) + rel
    else:
        old = torch.full_like(own, zero_row)
    final = buf[torch.where(rel >= 0, own, old)]  # [N, W-1, D]
    return y, final.permute(0, 2, 1).contiguous()


def causal_conv_qkv_torch(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                          weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seg_ids: torch.Tensor,
                          local_pos: torch.Tensor, cu_seqlens: torch.Tensor,
                          initial: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                          ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The q/k/v convs of a packed prefill: causal_conv_varlen_torch on each -> (3 outputs, 3 final windows)."""
    inits = (None, None, None) if initial is None else initial
    done = [causal_conv_varlen_torch(x, w, seg_ids, local_pos, cu_seqlens, init)
            for x, w, init in zip(xs, weights, inits, strict=True)]
    return tuple(y for y, _ in done), tuple(f for _, f in done)


def causal_conv_decode_torch(xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                             weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                             windows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], slots: torch.Tensor,
                             keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per sequence through the q/k/v convs at once, windows read from and written back to the pool.

    xs: 3 x [B, D] activations; weights: 3 x [D, W] in the activation dtype; windows: 3 pool views
    [n_slots, D, W-1] fp32, UPDATED in place (row slots[b] becomes its last W-1 inputs); slots [B] int64;
    keep [B] 0/1 (0: a fresh sequence, its window counts as zeros). Returns 3 x silu(conv) [B, D].
    Same elementwise ops, in the same order and dtype, as causal_conv_varlen_torch on a decode pack, so
    the two agree bit for bit; the taps of the three convs share each op (2W ops, not 3 x 2W gathers)."""
    dtype = xs[0].dtype
    W = weights[0].shape[1]
    old = torch.stack([win.index_select(0, slots) for win in windows]).to(dtype)  # [3, B, D, W-1]
    old = old * keep.to(dtype)[None, :, None, None]  # a multiply, as in the packed path: stale NaN stays loud
    taps = torch.cat([old, torch.stack(xs)[..., None]], dim=-1)  # [3, B, D, W], oldest first
    weight = torch.stack(weights)[:, None]  # [3, 1, D, W]
    acc = torch.zeros_like(taps[..., 0])
    for tap in range(W):
        acc = acc + taps[..., tap] * weight[..., tap]
    shifted = taps[..., 1:].float()
    for win, new in zip(windows, shifted, strict=True):
        win.index_copy_(0, slots, new)
    # one silu per conv over its own contiguous [B, D], the tensor the packed path applies it to: fp32 silu on
    # CPU rounds differently in its vectorized body and its tail, so one silu over [3, B, D] would not match
    q, k, v = (torch.nn.functional.silu(a) for a in acc)
    return q, k, v
