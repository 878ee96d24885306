"""KDA recurrence: `kda_prefill` (packed varlen, chunked) and `kda_decode_slots` (one token per
sequence, states read and written in place in the state pool).

CPU runs the torch reference (torch_ref); CUDA runs fla's Triton kernels when they accept the call,
else the torch reference with a logged reason (see kernels/registry.py).
"""

from __future__ import annotations

import torch

from k3verify.kernels.kda import fla_launch, forget_gate_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON, dispatch
from k3verify.kernels.varlen import DeviceSeqlens, Offsets

PREFILL = "kda.prefill"
# the same op over a static pack's device offsets (kernels/varlen.py; fla's use_graph mode): an op of its own, so a
# refusal or a raise there (the registry then disables the fast path for the process) leaves the eager prefill alone
PREFILL_STATIC = "kda.prefill_static"
DECODE_SLOTS = fla_launch.DECODE_SLOTS
DECODE_SLOTS_GATED = fla_launch.DECODE_SLOTS_GATED
FORGET_GATE_BETA = "kda.forget_gate_beta"
CHUNK = torch_ref.CHUNK

for _op in (PREFILL, PREFILL_STATIC):  # the same two backends; each op is disabled on its own
    REGISTRY.register(_op, TORCH, torch_ref.kda_prefill_torch)
    REGISTRY.register(_op, TRITON, fla_launch.kda_prefill_fla, accepts=fla_launch.accepts_prefill,
                      available=fla_launch.available)
REGISTRY.register(DECODE_SLOTS, TORCH, torch_ref.kda_decode_slots_torch)
REGISTRY.register(DECODE_SLOTS, TRITON, fla_launch.kda_decode_slots_fla, accepts=fla_launch.accepts_decode_slots,
                  available=fla_launch.available)
REGISTRY.register(DECODE_SLOTS_GATED, TORCH, torch_ref.kda_decode_slots_gated_torch)
REGISTRY.register(DECODE_SLOTS_GATED, TRITON, fla_launch.kda_decode_slots_gated_fla,
                  accepts=fla_launch.accepts_decode_slots_gated, available=fla_launch.available)
REGISTRY.register(FORGET_GATE_BETA, TORCH, torch_ref.kda_forget_gate_beta)
REGISTRY.register(FORGET_GATE_BETA, TRITON, forget_gate_launch.forget_gate_beta_triton,
                  accepts=forget_gate_launch.accepts, available=forget_gate_launch.available)


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: Offsets, initial_state: torch.Tensor, scale: float,
                lower_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q,k [T,h,dk] raw; v [T,h,dv]; g [T,h,dk] fp32 log decay; beta [T,h] post-sigmoid;
    initial_state [N,h,dk,dv] fp32 -> (o [T,h,dv], final_state [N,h,dk,dv] fp32). cu_seqlens: host offsets, or a
    static pack's device offsets (kernels/varlen.py; on CUDA fla's graph-capturable varlen mode)."""
    op = PREFILL_STATIC if isinstance(cu_seqlens, DeviceSeqlens) else PREFILL
    return dispatch(op, q, k, v, g, beta, cu_seqlens, initial_state, scale, lower_bound=lower_bound, device=q.device)


def kda_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool_state: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """torch_ref.kda_decode_torch over states that live in the pool: pool_state [n_slots, h, dk, dv] fp32 (one layer's
    view), slots [B]; row b reads and then overwrites pool_state[slots[b]] -> o [B, h, dv]."""
    return dispatch(DECODE_SLOTS, q, k, v, g, beta, pool_state, slots, scale, device=q.device)

def kda_decode_slots_gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f_raw: torch.Tensor,
                           dt_bias: torch.Tensor, a_log: torch.Tensor, b_logits: torch.Tensor,
                           pool_state: torch.Tensor, slots: torch.Tensor, scale: float,
                           lower_bound: float | None) -> torch.Tensor:
    """The serving decode step: kda_decode_slots with the gate and beta made from their raw inputs (f_b_proj's
    output f_raw [B, h*dk], dt_bias [h*dk], a_log [h] fp32, b_logits [B, h]) as torch_ref.kda_forget_gate / kda_beta
    make them; on CUDA inside fla's recurrence kernel."""
    return dispatch(DECODE_SLOTS_GATED, q, k, v, f_raw, dt_bias, a_log, b_logits, pool_state, slots, scale,
                    lower_bound, device=q.device)


def kda_forget_gate_beta(f_raw: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, b_logits: torch.Tensor,
                         heads: int, lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forget gate and beta of a prefill or score pass from their raw inputs (f_b_proj's output f_raw [T, D],
    dt_bias [D] fp32, the decay rate A = exp(A_log) [h] fp32, b_logits [T, h]) -> (g [T, h, dk], beta [T, h]), fp32:
    torch_ref.kda_forget_gate and kda_beta (six launches); on CUDA in bf16 one Triton launch
    (kernels/kda/forget_gate_kernel.py)."""
    return dispatch(FORGET_GATE_BETA, f_raw, dt_bias, A, b_logits, heads, lower_bound, device=f_raw.device)


from k3verify.kernels.kda import score as _score  # noqa: E402,F401  (registers the kda.score_* ops)
