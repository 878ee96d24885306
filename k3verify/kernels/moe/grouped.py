"""Routed-expert combine as two grouped GEMMs: static shapes, no host sync, CUDA-graph capturable.

The torch reference (`kernels/moe/torch_ref.py`) loops over experts with host-side
counts. This path sorts the T·k (token, expert) pairs by expert on the device, gathers the rows,
runs one grouped GEMM against the experts' gate|up rows and one against their down rows, then sums each
token's k weighted rows in fp32 without atomics (deterministic): on CUDA one Triton launch reading the rows
where they lie (kernels/moe/tail_kernel.py), elsewhere multiply, un-sort and sum in torch. Same math, other GEMM
kernels: compared with the reference by an RMS gate, never bit-exactly.

Two sets of grouped GEMMs share that routing: `torch._grouped_mm` over bf16 experts stacked as
[E, 2I, D] and [E, D, I] (dense and dequantized experts), and the MXFP4 grouped GEMM over the packed
experts as the checkpoint stores them (`PackedExperts`, the packed mode).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from k3verify.kernels.lazy import cuda_reason, lazy_module, loaded
from k3verify.kernels.moe import decode_launch
from k3verify.kernels.mxfp4 import grouped_mm
from k3verify.kernels.registry import REGISTRY

OP = "moe.combine"  # kernels.moe.COMBINE (that package imports this module)

# (rows sorted by expert [M, K], offs [E] int32 ends of each expert's rows) -> [M, N]: rows times their expert
GroupedMM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PackedExperts:
    """One layer's MXFP4 experts stacked: gate rows then up rows, and down; codes and E8M0 scales."""

    w13_codes: torch.Tensor  # [E, 2I, D/2] uint8
    w13_scales: torch.Tensor  # [E, 2I, D/group] uint8
    w2_codes: torch.Tensor  # [E, D, I/2] uint8
    w2_scales: torch.Tensor  # [E, D, I/group] uint8
    group: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13_codes, self.w13_scales, self.w2_codes,
                                                           self.w2_scales))


def available() -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    return None


# fp32 (any non-bf16 dtype) experts: each (token, expert) pair gathers its expert's weights, then two batched
# GEMVs. Capturable like the bf16 path; its memory grows with the pairs, so past this budget it refuses.
GATHER_BUDGET_BYTES = 1 << 30


def gather_max_pairs(moe: Any, width: int, element_size: int) -> int:
    """The most (token, expert) pairs the per-pair gather takes for `moe` at input `width` (GATHER_BUDGET_BYTES)."""
    return GATHER_BUDGET_BYTES // (3 * moe.intermediate_size * width * element_size)


def accepts(moe: Any, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
            add: torch.Tensor | None = None) -> str | None:
    if add is not None and (add.shape != x_in.shape or not add.is_contiguous()):
        return f"the row to add must be contiguous {tuple(x_in.shape)}; got {tuple(add.shape)}, stride {add.stride()}"
    if x_in.dtype != torch.bfloat16:
        max_pairs = gather_max_pairs(moe, x_in.shape[-1], x_in.element_size())
        if idx.numel() > max_pairs:  # one message per model and dtype: the registry warns once per reason
            return (f"{x_in.dtype} experts take the per-pair gather path up to {max_pairs} (token, expert) pairs "
                    f"({GATHER_BUDGET_BYTES / 2**30:.0f} GiB of gathered weights); larger batches run the reference "
                    "loop (not CUDA-graph capturable)")
        return None
    for name, n in (("expert input width", x_in.shape[-1]), ("expert intermediate", moe.intermediate_size)):
        if n % 16:
            return f"{name} {n} is not a multiple of 16 (grouped GEMM alignment)"
    return None


def sorted_combine(x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, num_experts: int,
                   gate_up: GroupedMM, down: GroupedMM, act: Glu) -> torch.Tensor:
    """x_in [T, D]; weights [T, k] fp32; idx [T, k]; gate_up -> [M, 2I] (gate columns then up columns);
    down -> [M, D] -> sum_k w_k expert_k(x_in) as fp32 [T, D]."""
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    rows = order // k
    xs = x_in.index_select(0, rows)  # [T*k, D], grouped by expert
    h = gate_up(xs, offs)  # [T*k, 2I]
    g, u = h.split(h.shape[-1] // 2, dim=-1)
    y = down(act(g, u).contiguous(), offs)  # [T*k, D]
    return sorted_sum(y, order, weights)


def sorted_sum_torch(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T*k, D] expert outputs in sorted order (`order`: sorted position -> pair t*k + j); weights [T, k] fp32
    -> [T, D] fp32, each token's k terms summed over k."""
    T, k = weights.shape
    w_sorted = weights.reshape(-1).index_select(0, order)
    # bf16 y times fp32 weights promotes to fp32 in one kernel (the same products as y.float() * w).
    # Un-sort with a permutation (unique targets) and reduce over k: deterministic. An index_add_ over
    # `rows` would add each token's k terms with float atomics in whatever order the GPU runs them,
    # so a CUDA-graph replay and the same step run eagerly could differ in the last bits.
    terms = torch.empty_like(y, dtype=torch.float32).index_copy_(0, order, torch.mul(y, w_sorted[:, None]))
    return terms.view(T, k, -1).sum(dim=1)


_tail = lazy_module("k3verify.kernels.moe.tail_kernel", "Triton MoE combine tail")
TAIL = "tail kernel"  # the Triton tail's name in the registry's refusals and disabled paths
TAIL_BLOCK_D = 512


def sorted_sum_triton(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, mod: ModuleType | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """sorted_sum_torch in one Triton launch (kernels/moe/tail_kernel.py): each token's k rows read where they
    lie, weighted and summed in route order. `mod` runs a test's variant of the kernel module; `out` (fp32
    [T, D], contiguous) receives the result (a test's poisoned buffer: every element must be written)."""
    mod = loaded(_tail) if mod is None else mod
    T, k = weights.shape
    reason = tail_refusal(y, order, weights)
    if reason is not None:
        raise ValueError(f"tail kernel: {reason}")
    inv = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    w = weights.contiguous()
    if out is None:
        out = torch.empty(T, y.shape[1], dtype=torch.float32, device=y.device)
    elif out.shape != (T, y.shape[1]) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"tail kernel: out {tuple(out.shape)} {out.dtype}; wants contiguous fp32 {(T, y.shape[1])}")
    if T:
        grid = (T, -(-y.shape[1] // TAIL_BLOCK_D))
        mod.moe_sorted_sum_kernel[grid](y, inv, w, out, y.shape[1], y.stride(0), out.stride(0),
                                        TOP_K=k, BLOCK_D=TAIL_BLOCK_D, num_warps=4)
    return out


def tail_refusal(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> str | None:
    """Why the Triton tail does not take these operands (None: it does). Its products are fp32 (the torch tail
    promotes bf16 outputs times fp32 weights the same way); other weight dtypes would round elsewhere."""
    T, k = weights.shape
    if y.dim() != 2 or y.shape[0] != T * k or y.stride(-1) != 1 or order.shape != (T * k,):
        return (f"expert outputs {tuple(y.shape)} (strides {y.stride()}) and order {tuple(order.shape)} for {T} "
                f"tokens x {k} routes; wants [T*k, D] with unit column stride")
    if weights.dtype != torch.float32:
        return f"route weights in {weights.dtype}; wants float32"
    return None


def sorted_sum(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The Triton tail on CUDA, else (or when it is unavailable or refuses the operands, or after it raised once)
    the torch tail, with the reason logged once (registry.refused_inside)."""
    if not y.is_cuda:
        return sorted_sum_torch(y, order, weights)
    out = REGISTRY.run_inside(OP, TAIL, cuda_reason(_tail) or tail_refusal(y, order, weights),
                              lambda: sorted_sum_triton(y, order, weights), "the torch tail (multiply, un-sort, sum)")
    return out if out is not None else sorted_sum_torch(y, order, weights)


def moe_grouped_combine(x_in: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        idx: torch.Tensor, act: Glu) -> torch.Tensor:
    """x_in [T, D]; w13 [E, 2I, D] (gate rows then up rows); w2 [E, D, I]; weights [T, k] fp32;
    idx [T, k] -> sum_k w_k expert_k(x_in) as fp32 [T, D]."""
    return sorted_combine(x_in, weights, idx, w13.shape[0],
                          lambda xs, offs: torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs),
                          lambda hs, offs: torch._grouped_mm(hs, w2.transpose(1, 2), offs=offs), act)


def moe_packed_combine(x_in: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, idx: torch.Tensor,
                       act: Glu) -> torch.Tensor:
    """As moe_grouped_combine, with both GEMMs reading the MXFP4 experts packed (kernels/mxfp4.grouped_mm)."""
    p = experts
    return sorted_combine(x_in, weights, idx, p.w13_codes.shape[0],
                          lambda xs, offs: grouped_mm(xs, p.w13_codes, p.w13_scales, offs, p.group),
                          lambda hs, offs: grouped_mm(hs, p.w2_codes, p.w2_scales, offs, p.group), act)


def moe_gathered_combine(x_in: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         idx: torch.Tensor, act: Glu) -> torch.Tensor:
    """The non-bf16 path (torch._grouped_mm is bf16 only): every (token, expert) pair gathers its expert's
    [2I, D] and [D, I] rows and runs two batched GEMVs. Static shapes, no host sync: CUDA-graph capturable,
    which the reference's loop over hit experts (host-side counts) is not. Each token's k terms are summed in
    route order (the reference adds them in expert order): an RMS gate, not bit-exact."""
    T, k = idx.shape
    flat = idx.reshape(-1)
    xs = x_in.repeat_interleave(k, dim=0)  # pair (t, j) -> x_in[t]
    h = torch.bmm(w13.index_select(0, flat), xs[:, :, None]).squeeze(-1)  # [T*k, 2I]
    g, u = h.split(h.shape[-1] // 2, dim=-1)
    y = torch.bmm(w2.index_select(0, flat), act(g, u)[:, :, None]).squeeze(-1)  # [T*k, D]
    return (y.float() * weights.reshape(-1, 1)).view(T, k, -1).sum(dim=1)


# which kernels the bf16 combine ran, per call: "decode" (kernels/moe/decode_launch.py) or "grouped"
PATHS: Counter[str] = Counter()
_FORCED: list[str] = []


@contextlib.contextmanager
def forced_path(path: str) -> Iterator[None]:
    """Pin the bf16 combine to "decode" or "grouped" whatever the step's size (checks, benchmarks); a pinned
    decode path that refuses raises instead of falling back."""
    if path not in ("decode", "grouped"):
        raise ValueError(f"unknown MoE combine path {path!r}; expected 'decode' or 'grouped'")
    _FORCED.append(path)
    try:
        yield
    finally:
        _FORCED.pop()


DECODE = "decode kernels"  # the path's name in the registry's refusals and disabled paths




def added(out: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """moe.combine's `add`: the fp32 sum rounded to add's dtype plus add (as the layer added its shared expert)."""
    return out if add is None else out.to(add.dtype) + add


def combine_grouped(moe: Any, x_in: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                    add: torch.Tensor | None = None) -> torch.Tensor:
    """Registry entry: the SparseMoE's experts stacked once (`moe.stacked_weights()`); bf16 steps of at most
    decode_launch.MAX_PAIRS pairs run the decode kernels (with `add`, summed, cast and added in their finish
    launch), larger ones two grouped GEMMs; other dtypes the per-pair gather. A decode-sized step the decode
    kernels refuse runs the grouped GEMMs with the reason logged once."""
    w13, w2 = moe.stacked_weights()
    if x_in.dtype != torch.bfloat16:
        return added(moe_gathered_combine(x_in, w13, w2, weights, idx, moe.act), add)
    forced = _FORCED[-1] if _FORCED else None
    if forced == "decode" or (forced is None and not decode_launch.too_large(idx.numel())):
        refusal = (REGISTRY.broken_inside(OP, DECODE) or decode_launch.available()
                   or decode_launch.accepts(x_in, w13, w2, weights, idx, getattr(moe, "glu", None)))
        if forced == "decode" and refusal is not None:
            raise RuntimeError(f"moe.combine pinned to the decode kernels, which refused: {refusal}")
        out = REGISTRY.run_inside(OP, DECODE, refusal, lambda: decode_launch.combine(x_in, w13, w2, weights, idx,
                                                                                   moe.glu, add=add),
                                  "the grouped GEMMs")
        if out is not None:
            PATHS["decode"] += 1
            return out
    PATHS["grouped"] += 1
    return added(moe_grouped_combine(x_in, w13, w2, weights, idx, moe.act), add)
