"""Acceptance and launcher of the decode-sized MoE combine (kernels/moe/decode_kernel.py): which calls it takes, its
tile sizes, and a lazy import so that importing k3verify never imports triton.

The CUDA combine (kernels/moe/grouped.py) sends bf16 steps of at most MAX_PAIRS (token, expert) pairs here
(decode, speculative score, small prefill chunks) and larger ones to the grouped GEMMs; a refusal for any
other reason is logged there, once per reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module, loaded

# The kernels scan all of a step's route ids per program: a power-of-two block of at most this many.
# 512 = batch 64 x top-8; larger steps run the grouped GEMMs, whose tiles reuse weights across rows.
MAX_PAIRS = 512
BLOCK_M = 16  # the smallest tensor-core dot: decode rows per expert are 1-16
BLOCK_K = 128  # fixed for every batch size: a pair's accumulation order never depends on its batch

_kernels = lazy_module("k3verify.kernels.moe.decode_kernel", "Triton MoE decode kernels")


@dataclass(frozen=True)
class GluSpec:
    """The expert MLP's GLU, as the kernel computes it: 'silu' (Kimi-Linear) or 'situ' (K3) with its betas."""

    kind: str
    beta: float = 1.0
    linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "situ"):
            raise ValueError(f"unknown GLU {self.kind!r}; expected 'silu' or 'situ'")
        if self.kind == "situ" and not self.beta:
            raise ValueError("SiTU needs a non-zero beta")


@dataclass(frozen=True)
class Tiles:
    block_n: int
    num_warps: int
    num_stages: int
    compact: bool = False  # the grid over the step's touched experts (one more launch) instead of all experts
    cols_first: bool = False  # grid (column blocks, experts): an expert's column blocks launched back to back


def available() -> str | None:
    return cuda_reason(_kernels)


def too_large(pairs: int) -> bool:
    """A step past the decode kernels' size: the grouped GEMMs' job (by design, not a refusal)."""
    return pairs > MAX_PAIRS


def accepts(x_in: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
            glu: GluSpec | None) -> str | None:
    if glu is None:
        return "the MoE layer did not say which GLU its experts use (SparseMoE.glu)"
    if x_in.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return f"activations and experts must be bf16; got {x_in.dtype}, {w13.dtype}, {w2.dtype}"
    (T, D), (E, two_i, D13), (E2, D2, I) = x_in.shape, w13.shape, w2.shape
    if D13 != D or D2 != D or E2 != E or two_i != 2 * I:
        return f"expert shapes do not fit x [{T}, {D}]: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    if idx.shape != weights.shape or idx.dim() != 2 or idx.shape[0] != T or weights.dtype != torch.float32:
        return f"idx / weights must be [{T}, k] (weights fp32); got {tuple(idx.shape)}, {tuple(weights.shape)} " \
               f"{weights.dtype}"
    if idx.numel() > MAX_PAIRS:
        return f"{idx.numel()} (token, expert) pairs exceed the decode kernels' {MAX_PAIRS}"
    if x_in.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        return f"rows must be contiguous; got strides {x_in.stride()}, {w13.stride()}, {w2.stride()}"
    if not all(t.is_cuda and t.device == x_in.device for t in (w13, w2, weights, idx)):
        return f"tensors are not all on {x_in.device}"
    return None


COMPACT_MAX_PAIRS = 16
COLS_FIRST_MIN_PAIRS = 129  # past 16 tokens of top-8


def pick_tiles(pairs: int) -> Tiles:
    """64-column blocks up to COLS_FIRST_MIN_PAIRS: on kl-48b shapes they beat 32 and 16 columns from 1 to 64
    tokens; 4 stages up to 64 pairs, 3 past that (the faster of the two at each size, within 1%). The compact
    grid at up to COMPACT_MAX_PAIRS pairs only: it wins at one and two tokens, ties at four and loses at every
    larger size. Past 128 pairs, 128-column blocks with an expert's column blocks launched back to back
    (cols_first), faster over a skewed router like the bench's and over uniform routing alike; at 16 tokens and
    fewer no grid won by more than 1% (docs/results/README.md lists the runs)."""
    if pairs >= COLS_FIRST_MIN_PAIRS:
        return Tiles(block_n=128, num_warps=4, num_stages=3, cols_first=True)
    return Tiles(block_n=64, num_warps=4, num_stages=4 if pairs <= 64 else 3, compact=pairs <= COMPACT_MAX_PAIRS)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def active_experts(flat: torch.Tensor, num_experts: int, mod: ModuleType | None = None) -> torch.Tensor:
    """The compact grid's list: the experts the step's route ids [M] name, ascending, then -1, min(M, E) entries
    (one program scans every id against every expert)."""
    mod = loaded(_kernels) if mod is None else mod
    M = flat.numel()
    m_pad, rows = max(_next_pow2(M), 16), min(M, num_experts)
    experts = torch.empty(rows, dtype=torch.int32, device=flat.device)
    mod.moe_active_experts_kernel[(1,)](flat, experts, M, num_experts, rows, M_PAD=m_pad,
                                        E_PAD=max(_next_pow2(num_experts), 16), CHUNK=min(m_pad, 64), num_warps=4)
    return experts


def combine(x_in: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
            glu: GluSpec, mod: ModuleType | None = None, tiles: Tiles | None = None,
            add: torch.Tensor | None = None) -> torch.Tensor:
    """x_in [T, D] bf16; w13 [E, 2I, D] (gate rows then up rows); w2 [E, D, I]; weights [T, k] fp32; idx [T, k]
    -> sum_k w_k expert_k(x_in) as fp32 [T, D], each token's terms added in route order; with `add` ([T, D], the
    shared expert's output) that sum rounded to add's dtype plus add, in add's dtype. `mod` runs a test's
    variant of the kernel module; `tiles` overrides pick_tiles (benchmarks)."""
    mod = loaded(_kernels) if mod is None else mod
    T, D = x_in.shape
    E, two_i, _ = w13.shape
    I, k = two_i // 2, idx.shape[1]
    M = T * k
    if M > MAX_PAIRS:
        raise ValueError(f"{M} (token, expert) pairs exceed the decode kernels' {MAX_PAIRS}")
    t = tiles or pick_tiles(M)
    flat = idx.reshape(-1)
    m_pad = max(_next_pow2(M), 16)
    rows, experts = E, flat  # experts: unread unless compact
    if t.compact:
        rows = min(M, E)
        experts = active_experts(flat, E, mod)

    def grid(cols: int) -> tuple[int, int]:
        return (cols, rows) if t.cols_first else (rows, cols)

    a = torch.empty(M, I, dtype=x_in.dtype, device=x_in.device)
    mod.moe_gate_up_kernel[grid(-(-I // t.block_n))](
        x_in, flat, experts, w13, a, M, k, I, D, x_in.stride(0), w13.stride(0), w13.stride(1), a.stride(0),
        float(glu.beta), float(glu.linear_beta or 1.0), ACT=0 if glu.kind == "silu" else 1,
        HAS_LIN=glu.linear_beta is not None, COMPACT=t.compact, M_PAD=m_pad, BLOCK_M=BLOCK_M, BLOCK_N=t.block_n,
        BLOCK_K=BLOCK_K, COLS_FIRST=t.cols_first, num_warps=t.num_warps, num_stages=t.num_stages)
    terms = torch.empty(M, D, dtype=torch.float32, device=x_in.device)
    mod.moe_down_kernel[grid(-(-D // t.block_n))](
        a, flat, experts, weights.reshape(-1), w2, terms, M, D, I, a.stride(0), w2.stride(0), w2.stride(1),
        terms.stride(0), COMPACT=t.compact, M_PAD=m_pad, BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=BLOCK_K,
        COLS_FIRST=t.cols_first, num_warps=t.num_warps, num_stages=t.num_stages)
    if add is not None and (add.shape != (T, D) or not add.is_contiguous() or add.device != x_in.device):
        raise ValueError(f"add must be a contiguous [{T}, {D}] on {x_in.device}; got {tuple(add.shape)}, stride "
                         f"{add.stride()}, {add.device}")
    out = torch.empty(T, D, dtype=torch.float32 if add is None else add.dtype, device=x_in.device)
    block = 1024  # one program per token and 1024 columns: k loads and adds a column, in route order
    mod.moe_finish_kernel[(T, -(-D // block))](terms, out if add is None else add, out, D, K_ROUTE=k,
                                               HAS_ADD=add is not None, BLOCK=block, num_warps=4)
    return out
