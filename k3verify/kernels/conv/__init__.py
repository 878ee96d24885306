"""Causal depthwise conv + SiLU with per-sequence windows (KDA's q/k/v short convs).

`causal_conv`: one conv over a packed prefill (any number of tokens per sequence), torch only.
`causal_conv_qkv`: the layer's three convs of a packed prefill at once; Triton on CUDA (two launches: the
outputs, then the final windows), else causal_conv on each (the gather form costs ~40 small kernels per conv,
about a third of a kl-48b-8l prefill's launches before the kernel).
`conv_decode_qkv`: one token per sequence for all three convs
at once, windows read from and written back to the state pool; Triton on CUDA (one launch), else the
torch reference, which equals the packed path on a decode pack bit for bit.
"""

from __future__ import annotations

import torch

from k3verify.kernels.conv import conv_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, dispatch

CAUSAL = "conv.causal"
CAUSAL_DECODE = "conv.causal_decode"
CAUSAL_QKV = "conv.causal_qkv"
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

REGISTRY.register(CAUSAL, TORCH, torch_ref.causal_conv_varlen_torch)
REGISTRY.register(CAUSAL_QKV, TORCH, torch_ref.causal_conv_qkv_torch)
REGISTRY.register(CAUSAL_QKV, TRITON, conv_launch.causal_conv_qkv_fast, accepts=conv_launch.accepts_prefill,
                  available=conv_launch.available_prefill)
REGISTRY.register(CAUSAL_DECODE, TORCH, torch_ref.causal_conv_decode_torch)
REGISTRY.register(CAUSAL_DECODE, TRITON, conv_launch.conv_decode_qkv_fast, accepts=conv_launch.accepts_decode,
                  available=conv_launch.available)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, seg_ids: torch.Tensor, local_pos: torch.Tensor,
                cu_seqlens: torch.Tensor, initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """See torch_ref.causal_conv_varlen_torch."""
    return dispatch(CAUSAL, x, weight, seg_ids, local_pos, cu_seqlens, initial, device=x.device)


def causal_conv_qkv(xs: QKV, weights: QKV, seg_ids: torch.Tensor, local_pos: torch.Tensor,
                    cu_seqlens: torch.Tensor, initial: QKV | None) -> tuple[tuple[torch.Tensor, ...],
                                                                           tuple[torch.Tensor, ...]]:
    """xs 3 x [T, D] (q/k/v projections of a pack); weights 3 x [D, W] (activation dtype); initial 3 x [N, D, W-1]
    in the activation dtype, or None (fresh sequences) -> (3 x silu(conv) [T, D], 3 x final windows [N, D, W-1]).
    See torch_ref.causal_conv_varlen_torch."""
    return dispatch(CAUSAL_QKV, xs, weights, seg_ids, local_pos, cu_seqlens, initial, device=xs[0].device)


def conv_decode_qkv(xs: QKV, weights: QKV, windows: QKV, slots: torch.Tensor, keep: torch.Tensor) -> QKV:
    """xs 3 x [B, D]; weights 3 x [D, W] (activation dtype); windows 3 x [n_slots, D, W-1] fp32 pool views,
    updated in place; slots [B]; keep [B] 0/1 -> 3 x silu(conv) [B, D]. See torch_ref.causal_conv_decode_torch."""
    return dispatch(CAUSAL_DECODE, xs, weights, windows, slots, keep, device=xs[0].device)
