"""Acceptance and launchers of the Triton KDA score kernels (score_kernel.py): availability, per-call acceptance
(a refusal names the value; the registry logs it and runs the reference), and a lazy import so that
importing k3verify never imports triton. The launchers keep the contracts of score_ref / kda_score."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
MAX_HEAD_DIM = 128  # a program holds a [VALUE_BLOCK, dk] fp32 state block (and the norm a [dv] row)
MAX_WIDTH = 8
MAX_POSITIONS = 16
VALUE_BLOCK = 32  # state columns per program: a [32, dk] fp32 block stays in registers (128 x 128 spills)


@dataclass(frozen=True)
class Launch:
    """How a recording kernel is launched: value columns per program, warps, and a register cap (None: the
    compiler's choice). None of it changes a value: each state column's arithmetic is the same in any block, and
    every reduction is a fixed tree (score_kernel.py), so every launch writes the same bits."""

    value_block: int = VALUE_BLOCK
    num_warps: int = 4
    maxnreg: int | None = None
    unroll: bool = False  # the positions unrolled at compile time (the kernels' UNROLL): the same code, unrolled
    stages: int | None = None  # Triton's num_stages (software pipelining of the positions' loads); None: its default

    def options(self) -> dict[str, int | bool]:
        """Launch / compile options: no mul+add contracted into an fma (score_kernel.py: the bit-identity rules)."""
        cap = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        stages = {} if self.stages is None else {"num_stages": self.stages}
        return {"num_warps": self.num_warps, "enable_fp_fusion": False} | cap | stages


# Capped at 128 registers (the compiler spills ~90 bytes): a program of either kernel otherwise holds 170-200
# (Triton 3.6), two fit on an SM, and rows x heads x value blocks run in waves of 264 programs. On one layer of
# kl-48b-8l the cap is as fast at 1-2 rows and faster from 4 rows on, for the unfused chain and the fused kernel
# alike (docs/results/ has the runs).
RECORD_LAUNCH = Launch(VALUE_BLOCK, 4, 128)
FUSED_LAUNCH = Launch(VALUE_BLOCK, 4, 128)
MAX_HEAD_TICKETS = 1 << 16  # rows x heads of one fused launch
_kernels = lazy_module("k3verify.kernels.kda.score_kernel", "Triton KDA score kernels")


def available() -> str | None:
    return cuda_reason(_kernels)


def _module() -> ModuleType:
    mod = _kernels()
    if isinstance(mod, str):
        raise RuntimeError(mod)
    return mod


def _dtype_reason(dtype: torch.dtype) -> str | None:
    if dtype != torch.bfloat16:
        return (f"activation dtype {dtype} is not bfloat16: the exact fp32 path is the torch reference (the kernels' "
                "exp and reduction order are a few ulps off torch's)")
    return None


def _conv_reason(xs: QKV, weights: QKV, windows: QKV, slots: torch.Tensor, keep: torch.Tensor,
                 records: torch.Tensor) -> str | None:
    B, N, D = xs[0].shape
    W = weights[0].shape[-1]
    s_x = xs[0].stride(1)
    if any(x.shape != (B, N, D) or x.stride() != (N * s_x, s_x, 1) for x in xs) or s_x < D:
        return (f"q/k/v projections must be [{B}, {N}, {D}] with unit column stride and one row stride (column "
                f"slices of a GEMM's rows are fine); got {[(tuple(x.shape), x.stride()) for x in xs]}")
    if any(w.shape != (D, W) or w.dtype != xs[0].dtype for w in weights):
        return f"conv weights must be [{D}, W] in {xs[0].dtype}; got {[(tuple(w.shape), w.dtype) for w in weights]}"
    if not 2 <= W <= MAX_WIDTH or not 2 <= N <= MAX_POSITIONS:
        return f"conv width {W} / positions {N} outside the unrolled ranges [2, {MAX_WIDTH}] / [2, {MAX_POSITIONS}]"
    if len({(t.shape, t.stride(), t.dtype) for t in windows}) != 1 or windows[0].dtype != torch.float32 \
            or windows[0].shape[1:] != (D, W - 1):
        return f"windows must be three fp32 [slots, {D}, {W - 1}] views with one stride; got {windows[0].shape}"
    if records.shape != (B, N, 3, D, W - 1) or records.dtype != torch.float32 or not records.is_contiguous():
        return f"conv records must be contiguous fp32 [{B}, {N}, 3, {D}, {W - 1}]; got {tuple(records.shape)}"
    if slots.shape != (B,) or keep.shape != (B,) or slots.dtype != torch.int64:
        return f"slots / keep must be [{B}] (slots int64); got {tuple(slots.shape)} {slots.dtype}, {tuple(keep.shape)}"
    return None


def _record_reason(q: torch.Tensor, pool_state: torch.Tensor, state_records: torch.Tensor) -> str | None:
    B, N, H, DK = q.shape
    if DK > MAX_HEAD_DIM:
        return f"head dim {DK} exceeds {MAX_HEAD_DIM} (one [{VALUE_BLOCK}, dk] fp32 state block per program)"
    if pool_state.shape[1:] != (H, DK, DK) or pool_state.dtype != torch.float32 or not pool_state.is_contiguous():
        return f"the pool state must be contiguous fp32 [slots, {H}, {DK}, {DK}] (dv = dk); got {pool_state.shape}"
    if state_records.shape != (B, N, H, DK, DK) or state_records.dtype != torch.float32 \
            or not state_records.is_contiguous():
        return f"state records must be contiguous fp32 [{B}, {N}, {H}, {DK}, {DK}]; got {tuple(state_records.shape)}"
    return None


def _device_reason(*tensors: torch.Tensor) -> str | None:
    return None if all(t.is_cuda for t in tensors) else "tensors are not all on CUDA"


def accepts_conv(xs: QKV, weights: QKV, windows: QKV, slots: torch.Tensor, keep: torch.Tensor,
                 records: torch.Tensor) -> str | None:
    return (_dtype_reason(xs[0].dtype) or _conv_reason(xs, weights, windows, slots, keep, records)
            or _device_reason(*xs, *weights, *windows, slots, keep, records))


def accepts_record(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   pool_state: torch.Tensor, slots: torch.Tensor, scale: float,
                   records: torch.Tensor) -> str | None:
    if any(not t.is_contiguous() for t in (q, k, v, g, beta)) or g.dtype != torch.float32 \
            or beta.dtype != torch.float32:
        return "q, k, v, g, beta must be contiguous, g and beta fp32"
    return _dtype_reason(q.dtype) or _record_reason(q, pool_state, records) or _device_reason(q, pool_state, records)


def accepts_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> str | None:
    if x.shape != gate.shape or not x.is_contiguous() or not gate.is_contiguous() or weight.shape != x.shape[-1:]:
        return f"x and gate must be contiguous of one shape with weight [{x.shape[-1]}]; got {tuple(gate.shape)}"
    if x.shape[-1] > MAX_HEAD_DIM:
        return f"row width {x.shape[-1]} exceeds {MAX_HEAD_DIM}"
    return _dtype_reason(x.dtype) or _device_reason(x, gate, weight)


def accepts_fused(xs: QKV, weights: QKV, windows: QKV, pool_state: torch.Tensor, slots: torch.Tensor,
                  keep: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, scale: float, conv_records: torch.Tensor,
                  state_records: torch.Tensor) -> str | None:
    reason = accepts_conv(xs, weights, windows, slots, keep, conv_records) or \
        _record_reason(g, pool_state, state_records)
    if reason is None and g.shape[0] * g.shape[2] > MAX_HEAD_TICKETS:
        reason = f"{g.shape[0]} rows x {g.shape[2]} heads exceed the {MAX_HEAD_TICKETS} head tickets of a fused launch"
    if reason is None and (not g.is_contiguous() or not beta.is_contiguous() or not gate.is_contiguous()
                           or g.dtype != torch.float32 or beta.dtype != torch.float32 or gate.dtype != xs[0].dtype):
        reason = "g / beta (fp32) and gate (activation dtype) must be contiguous"
    return reason


def _pow2(n: int) -> tuple[int, int]:
    p = max(2, 1 << (n - 1).bit_length())
    return p, int(math.log2(p))


def spec_conv_triton(xs: QKV, weights: QKV, windows: QKV, slots: torch.Tensor, keep: torch.Tensor,
                     records: torch.Tensor) -> QKV:
    """score_ref.spec_conv_qkv_torch's contract (callers go through accepts_conv)."""
    mod = _module()
    B, N, D = xs[0].shape
    W = weights[0].shape[-1]
    out = torch.empty((3, B, N, D), dtype=xs[0].dtype, device=xs[0].device)
    block = min(512, max(32, _pow2(D)[0]))
    mod.spec_conv_kernel[(B, -(-D // block))](
        *xs, *(w.contiguous() for w in weights), *windows, out[0], out[1], out[2], records, slots, keep, D,
        xs[0].stride(1), *windows[0].stride(), N=N, W=W, BF16=xs[0].dtype == torch.bfloat16, BLOCK_D=block,
        num_warps=4 if block >= 256 else 1, enable_fp_fusion=False)
    return out[0], out[1], out[2]


def record_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  pool_state: torch.Tensor, slots: torch.Tensor, scale: float, records: torch.Tensor, *,
                  launch: Launch | None = None) -> torch.Tensor:
    """score_ref.kda_record_torch's contract (callers go through accepts_record)."""
    mod = _module()
    launch = launch or RECORD_LAUNCH
    B, N, H, DK = q.shape
    DV = v.shape[-1]
    o = torch.empty((B, N, H, DV), dtype=v.dtype, device=v.device)
    BK, log2k = _pow2(DK)
    BV = min(launch.value_block, _pow2(DV)[0])
    mod.kda_record_kernel[(B, H, -(-DV // BV))](q, k, v, g, beta, pool_state, slots, records, o, scale, H, DK, DV, N=N,
                                                BK=BK, BV=BV, LOG2K=log2k, BF16=v.dtype == torch.bfloat16,
                                                UNROLL=launch.unroll,
                                                **launch.options())
    return o


def norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.norm.torch_ref.gated_rms_norm_torch's contract (callers go through accepts_norm)."""
    mod = _module()
    DV = x.shape[-1]
    y = torch.empty_like(x)
    BV, log2v = _pow2(DV)
    mod.gated_norm_kernel[(x.numel() // DV,)](x, gate, weight, y, eps, DV, BV=BV, LOG2V=log2v,
                                             BF16=x.dtype == torch.bfloat16, num_warps=1, enable_fp_fusion=False)
    return y


def fused_triton(xs: QKV, weights: QKV, windows: QKV, pool_state: torch.Tensor, slots: torch.Tensor,
                 keep: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, scale: float, conv_records: torch.Tensor, state_records: torch.Tensor, *,
                 launch: Launch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.kda.score.kda_score's contract in one launch (callers go through accepts_fused)."""
    mod = _module()
    launch = launch or FUSED_LAUNCH
    B, N, H, DK = g.shape
    o = torch.empty((B, N, H, DK), dtype=xs[0].dtype, device=g.device)
    y = torch.empty_like(o)
    BK, log2k = _pow2(DK)
    BV = min(launch.value_block, BK)
    mod.kda_score_fused_kernel[(B, H, -(-DK // BV))](
        *xs, *(w.contiguous() for w in weights), *windows, xs[0].stride(1), *windows[0].stride(), slots, keep,
        pool_state, g, beta,
        gate, norm_weight, conv_records, state_records, o, y, head_counters(g.device), scale, eps, H, DK, DK, N=N,
        W=weights[0].shape[-1], BK=BK, BV=BV, NVB=-(-DK // BV), BVF=BK, LOG2K=log2k, LOG2V=log2k,
        BF16=xs[0].dtype == torch.bfloat16, UNROLL=launch.unroll, **launch.options())
    return o, y


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def head_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 tickets, one per (row, head) of a fused launch, allocated once per device (before any CUDA-graph
    capture: the fused launch is its only user, and it leaves every ticket back at zero)."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_HEAD_TICKETS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


