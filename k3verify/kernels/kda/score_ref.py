"""Speculative score of a KDA layer in plain torch: n = k+1 tokens per sequence ([last accepted, k drafts]),
recording what each position leaves behind so that any accepted prefix can be committed exactly.

Nothing here writes the state pool: the pool holds the state before the score until a commit copies
record[a] (a = accepted drafts) into it. Each position runs exactly the ops of one decode step
(conv.causal_decode, kda.decode_slots) on tensors of the same shape, so on one device record[j] equals,
bit for bit, the state that j+1 sequential decode steps would have left in the pool.

Shapes: B sequences, n positions, D = heads * dk channels, W conv width, h heads, dk = dv head dim.
"""

from __future__ import annotations

import torch

from k3verify.kernels.kda.torch_ref import kda_decode_torch

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def spec_conv_qkv_torch(xs: QKV, weights: QKV, windows: QKV, slots: torch.Tensor, keep: torch.Tensor,
                        records: torch.Tensor) -> QKV:
    """The q/k/v short convs over n positions per sequence.

    xs: 3 x [B, n, D] projections (activation dtype); weights: 3 x [D, W] (activation dtype); windows: 3 pool
    views [n_slots, D, W-1] fp32, READ only; slots [B]; keep [B] 0/1 (0: the pool window counts as zeros);
    records [B, n, 3, D, W-1] fp32, WRITTEN: records[b, j, c] is conv c's window after position j.
    Returns 3 x silu(conv) [B, n, D]. Per position: causal_conv_decode_torch's ops in its order and shapes."""
    dtype, n = xs[0].dtype, xs[0].shape[1]
    window = torch.stack([w.index_select(0, slots) for w in windows])  # [3, B, D, W-1] fp32
    weight = torch.stack(weights)[:, None]  # [3, 1, D, W]
    x_all = torch.stack(xs)  # [3, B, n, D]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for j in range(n):
        old = window.to(dtype) * keep.to(dtype)[None, :, None, None]
        taps = torch.cat([old, x_all[:, :, j, :, None]], dim=-1)  # [3, B, D, W], oldest first
        acc = torch.zeros_like(taps[..., 0])
        for tap in range(taps.shape[-1]):
            acc = acc + taps[..., tap] * weight[..., tap]
        window = taps[..., 1:].float()
        records[:, j] = window.transpose(0, 1)
        for c in range(3):  # one silu per conv over its own [B, D], as the decode step applies it
            outs[c].append(torch.nn.functional.silu(acc[c]))
    q, k, v = (torch.stack(o, dim=1) for o in outs)
    return q, k, v


def kda_record_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool_state: torch.Tensor, slots: torch.Tensor, scale: float,
                     records: torch.Tensor) -> torch.Tensor:
    """The recurrence over n positions, recording every state.

    q, k, g: [B, n, h, dk] (g fp32 log decay); v: [B, n, h, dv]; beta: [B, n, h] post-sigmoid; pool_state
    [n_slots, h, dk, dv] fp32, READ only; slots [B]; records [B, n, h, dk, dv] fp32, WRITTEN: records[b, j] is
    the state after position j. Returns o [B, n, h, dv] in v's dtype."""
    state = pool_state.index_select(0, slots)
    outs = []
    for j in range(q.shape[1]):
        # contiguous per-position slices: the decode step sees [B, h, dk] tensors laid out as these
        o, state = kda_decode_torch(q[:, j].contiguous(), k[:, j].contiguous(), v[:, j].contiguous(),
                                    g[:, j].contiguous(), beta[:, j].contiguous(), state, scale)
        records[:, j] = state
        outs.append(o)
    return torch.stack(outs, dim=1)
