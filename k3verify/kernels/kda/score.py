"""The score pass of a KDA layer: short convs + recording recurrence + gated RMSNorm over n = k+1 tokens
per sequence, recording each position's conv windows and recurrent state (the pool is only read).

Two paths, same contract (`kda_score`):
- unfused: three ops, `kda.score_conv`, `kda.score_record`, `kda.score_norm` (torch references in
  score_ref / kernels.norm; Triton kernels on CUDA for bf16);
- fused (`fused=True`, behind `--kda-fused-score`): op `kda.score_fused`, one Triton launch on CUDA that
  must equal the unfused Triton path bit for bit. Its reference backend IS the unfused path, so a geometry
  the fused kernel refuses runs the three ops with one logged warning (kernels/registry.py), and
  REGISTRY.last_backend["kda.score_fused"] says which path ran.
"""

from __future__ import annotations

import torch

from k3verify.kernels.kda import score_launch, score_ref
from k3verify.kernels.norm import torch_ref as norm_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, dispatch

SCORE_CONV = "kda.score_conv"
SCORE_RECORD = "kda.score_record"
SCORE_NORM = "kda.score_norm"
SCORE_FUSED = "kda.score_fused"
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
ScoreOut = tuple[torch.Tensor, torch.Tensor]


def kda_score_unfused(xs: QKV, weights: QKV, windows: QKV, pool_state: torch.Tensor, slots: torch.Tensor,
                       keep: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, scale: float, conv_records: torch.Tensor,
                       state_records: torch.Tensor) -> ScoreOut:
    """Three ops: conv (records windows), recurrence (records states), gated norm. See kda_score."""
    B, n, h, dk = g.shape
    q, k, v = dispatch(SCORE_CONV, xs, weights, windows, slots, keep, conv_records, device=g.device)
    o = dispatch(SCORE_RECORD, q.view(B, n, h, dk), k.view(B, n, h, dk), v.view(B, n, h, -1), g, beta,
                 pool_state, slots, scale, state_records, device=g.device)
    y = dispatch(SCORE_NORM, o, gate, norm_weight, eps, device=g.device)
    return o, y


REGISTRY.register(SCORE_CONV, TORCH, score_ref.spec_conv_qkv_torch)
REGISTRY.register(SCORE_CONV, TRITON, score_launch.spec_conv_triton, accepts=score_launch.accepts_conv,
                  available=score_launch.available)
REGISTRY.register(SCORE_RECORD, TORCH, score_ref.kda_record_torch)
REGISTRY.register(SCORE_RECORD, TRITON, score_launch.record_triton, accepts=score_launch.accepts_record,
                  available=score_launch.available)
REGISTRY.register(SCORE_NORM, TORCH, norm_ref.gated_rms_norm_torch)
REGISTRY.register(SCORE_NORM, TRITON, score_launch.norm_triton, accepts=score_launch.accepts_norm,
                  available=score_launch.available)
# the fused op's reference backend is the unfused path itself: a refused geometry runs the three ops
REGISTRY.register(SCORE_FUSED, TORCH, kda_score_unfused)
REGISTRY.register(SCORE_FUSED, TRITON, score_launch.fused_triton, accepts=score_launch.accepts_fused,
                  available=score_launch.available)


def kda_score(xs: QKV, weights: QKV, windows: QKV, pool_state: torch.Tensor, slots: torch.Tensor,
               keep: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor,
               eps: float, scale: float, conv_records: torch.Tensor, state_records: torch.Tensor, *,
               fused: bool) -> ScoreOut:
    """One KDA layer's score over B sequences x n positions.

    xs: 3 x [B, n, D] q/k/v projections; weights: 3 x [D, W] conv weights (activation dtype); windows: 3 pool
    views [n_slots, D, W-1] fp32 and pool_state [n_slots, h, dk, dv] fp32, both READ only; slots [B]; keep [B]
    0/1; g [B, n, h, dk] fp32 log decay; beta [B, n, h] post-sigmoid fp32; gate [B, n, h, dk] output gate
    (activation dtype); norm_weight [dk] fp32. WRITTEN: conv_records [B, n, 3, D, W-1] fp32 (windows after
    each position) and state_records [B, n, h, dk, dv] fp32 (state after each position).
    Returns (o [B, n, h, dv] recurrence output, y [B, n, h, dv] gated-normed output), activation dtype."""
    args = (xs, weights, windows, pool_state, slots, keep, g, beta, gate, norm_weight, eps, scale, conv_records,
            state_records)
    if fused:
        return dispatch(SCORE_FUSED, *args, device=g.device)
    return kda_score_unfused(*args)
