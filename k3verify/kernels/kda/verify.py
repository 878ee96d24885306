"""Speculative verify of a KDA layer: short convs + recording recurrence + gated RMSNorm over n = k+1 tokens
per sequence, recording each position's conv windows and recurrent state (the pool is only read).

Two paths, same contract (`kda_verify`):
- unfused: three ops, `kda.verify_conv`, `kda.verify_record`, `kda.verify_norm` (torch references in
  verify_ref / kernels.norm; Triton kernels on CUDA for bf16);
- fused (`fused=True`, behind `--kda-fused-verify`): op `kda.verify_fused`, one Triton launch on CUDA that
  must equal the unfused Triton path bit for bit. Its reference backend IS the unfused path, so a geometry
  the fused kernel refuses runs the three ops with one logged warning (kernels/registry.py), and
  REGISTRY.last_backend["kda.verify_fused"] says which path ran.
"""

from __future__ import annotations

import torch

from k3verify.kernels.kda import verify_ref, verify_triton
from k3verify.kernels.norm import torch_ref as norm_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, dispatch

VERIFY_CONV = "kda.verify_conv"
VERIFY_RECORD = "kda.verify_record"
VERIFY_NORM = "kda.verify_norm"
VERIFY_FUSED = "kda.verify_fused"
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
VerifyOut = tuple[torch.Tensor, torch.Tensor]


def kda_verify_unfused(xs: QKV, weights: QKV, windows: QKV, pool_state: torch.Tensor, slots: torch.Tensor,
                       keep: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, scale: float, conv_records: torch.Tensor,
                       state_records: torch.Tensor) -> VerifyOut:
    """Three ops: conv (records windows), recurrence (records states), gated norm. See kda_verify."""
    B, n, h, dk = g.shape
    q, k, v = dispatch(VERIFY_CONV, xs, weights, windows, slots, keep, conv_records, device=g.device)
    o = dispatch(VERIFY_RECORD, q.view(B, n, h, dk), k.view(B, n, h, dk), v.view(B, n, h, -1), g, beta,
                 pool_state, slots, scale, state_records, device=g.device)
    y = dispatch(VERIFY_NORM, o, gate, norm_weight, eps, device=g.device)
    return o, y


REGISTRY.register(VERIFY_CONV, TORCH, verify_ref.spec_conv_qkv_torch)
REGISTRY.register(VERIFY_CONV, TRITON, verify_triton.spec_conv_triton, accepts=verify_triton.accepts_conv,
                  available=verify_triton.available)
REGISTRY.register(VERIFY_RECORD, TORCH, verify_ref.kda_record_torch)
REGISTRY.register(VERIFY_RECORD, TRITON, verify_triton.record_triton, accepts=verify_triton.accepts_record,
                  available=verify_triton.available)
REGISTRY.register(VERIFY_NORM, TORCH, norm_ref.gated_rms_norm_torch)
REGISTRY.register(VERIFY_NORM, TRITON, verify_triton.norm_triton, accepts=verify_triton.accepts_norm,
                  available=verify_triton.available)
# the fused op's reference backend is the unfused path itself: a refused geometry runs the three ops
REGISTRY.register(VERIFY_FUSED, TORCH, kda_verify_unfused)
REGISTRY.register(VERIFY_FUSED, TRITON, verify_triton.fused_triton, accepts=verify_triton.accepts_fused,
                  available=verify_triton.available)


def kda_verify(xs: QKV, weights: QKV, windows: QKV, pool_state: torch.Tensor, slots: torch.Tensor,
               keep: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor,
               eps: float, scale: float, conv_records: torch.Tensor, state_records: torch.Tensor, *,
               fused: bool) -> VerifyOut:
    """One KDA layer's verify over B sequences x n positions.

    xs: 3 x [B, n, D] q/k/v projections; weights: 3 x [D, W] conv weights (activation dtype); windows: 3 pool
    views [n_slots, D, W-1] fp32 and pool_state [n_slots, h, dk, dv] fp32, both READ only; slots [B]; keep [B]
    0/1; g [B, n, h, dk] fp32 log decay; beta [B, n, h] post-sigmoid fp32; gate [B, n, h, dk] output gate
    (activation dtype); norm_weight [dk] fp32. WRITTEN: conv_records [B, n, 3, D, W-1] fp32 (windows after
    each position) and state_records [B, n, h, dk, dv] fp32 (state after each position).
    Returns (o [B, n, h, dv] recurrence output, y [B, n, h, dv] gated-normed output), activation dtype."""
    args = (xs, weights, windows, pool_state, slots, keep, g, beta, gate, norm_weight, eps, scale, conv_records,
            state_records)
    if fused:
        return dispatch(VERIFY_FUSED, *args, device=g.device)
    return kda_verify_unfused(*args)
