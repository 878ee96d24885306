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
