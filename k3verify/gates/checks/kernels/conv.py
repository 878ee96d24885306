"""The KDA short-conv decode step (kernels.conv.conv_decode_qkv) against the packed gather conv.

- kernel.conv.decode: the torch decode reference equals the packed conv on a decode pack (B sequences of
  one token, windows as initial state) bit for bit, outputs and advanced windows, bf16 and fp32; rows
  with keep=0 carry stale windows and the pack repeats the scratch slot, as a padded graph bucket does.
- kernel.conv.decode_triton (CUDA): the Triton kernel behind the registry against the torch reference.
- kernel.conv.prefill_triton (CUDA): the Triton prefill convs (q/k/v, outputs and final windows) against the
  torch gather conv on a pack of fresh and continuing sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.kernels import conv as conv_ops
from k3verify.kernels.conv import conv_launch, torch_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON
from k3verify.serving.batch import PackedBatch

SLOTS = [3, 0, 5, 1, 0, 8, 6]  # slot 0 = scratch, twice (padded rows)
KEEP = [1, 0, 1, 0, 0, 1, 1]  # slot 1 is a fresh sequence over a stale window
NUM_SLOTS = 10
IDLE_SENTINEL = 1e30  # idle slots must come back untouched
Case = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
DecodeFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _case(ctx: CheckContext, dtype: torch.dtype) -> Case:
    """(xs 3 x [B, D], weights 3 x [D, W], pool windows 3 x [NUM_SLOTS, D, W-1] fp32 with idle sentinels)."""
    if not ctx.cfg.has_kda:
        raise SkipCheck("preset has no KDA layers")
    g, B, D, W = ctx.generator, len(SLOTS), ctx.cfg.kda_dim, ctx.cfg.conv_kernel_size
    xs = tuple(torch.randn(B, D, generator=g).to(dtype).to(ctx.device) for _ in range(3))
    weights = tuple((torch.randn(D, W, generator=g) * 0.5).to(dtype).to(ctx.device) for _ in range(3))
    windows = []
    for _ in range(3):
        win = torch.full((NUM_SLOTS, D, W - 1), IDLE_SENTINEL)
        win[SLOTS] = torch.randn(len(SLOTS), D, W - 1, generator=g).to(dtype).float()
        windows.append(win.to(ctx.device))
    return xs, weights, tuple(windows)


def _packed(xs: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...], windows: tuple[torch.Tensor, ...],
            slots: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """The packed gather conv on a decode pack; returns outputs and each row's advanced window (fp32)."""
    B, dev = slots.numel(), slots.device
    seg, cu = torch.arange(B, device=dev), torch.arange(B + 1, device=dev)
    zero = torch.zeros(B, dtype=torch.long, device=dev)
    out = {}
    for name, x, w, win in zip("qkv", xs, weights, windows, strict=True):
        init = win.index_select(0, slots).to(x.dtype) * keep.to(x.dtype)[:, None, None]
        out[name], final = torch_ref.causal_conv_varlen_torch(x, w, seg, zero, cu, init)
        out[f"window_{name}"] = final.float()
    return out


def _decoded(fn: DecodeFn, case: Case, slots: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run a decode implementation on copies of the pool; outputs and the windows each row now holds."""
    xs, weights, windows = case
    pool = tuple(w.clone() for w in windows)
    ys = fn(xs, weights, pool, slots, keep)
    out = dict(zip("qkv", ys, strict=True))
    real = slots != 0  # scratch rows may race on slot 0; compare them through their outputs only
    idle = torch.tensor([s for s in range(NUM_SLOTS) if s not in SLOTS], device=slots.device)
    for name, win in zip("qkv", pool, strict=True):
        out[f"window_{name}"] = win.index_select(0, slots)
        out[f"window_{name}"][~real] = 0.0
        out[f"idle_{name}"] = win.index_select(0, idle)
    return out


def _expected(case: Case, slots: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    ref = _packed(*case, slots, keep)
    idle = torch.tensor([s for s in range(NUM_SLOTS) if s not in SLOTS], device=slots.device)
    for name, win in zip("qkv", case[2], strict=True):
        ref[f"window_{name}"][slots == 0] = 0.0
        ref[f"idle_{name}"] = win.index_select(0, idle)
    return ref


@register_check(
    id="kernel.conv.decode", component="kernel", level="kernel", kind=Kind.BITEXACT,
    control="fresh rows (keep=0) convolve their stale window",
)
@builders.single_thread
def check_conv_decode(ctx: CheckContext) -> Trial:
    slots = torch.tensor(SLOTS, device=ctx.device)
    keep = torch.tensor(KEEP, device=ctx.device)
    ref: dict[str, torch.Tensor] = {}
    cand: dict[str, torch.Tensor] = {}
    ctrl: dict[str, torch.Tensor] = {}
    for dtype in (torch.bfloat16, torch.float32):
        case = _case(ctx, dtype)
        tag = str(dtype).removeprefix("torch.")
        fn = torch_ref.causal_conv_decode_torch
        for out, got in ((ref, _expected(case, slots, keep)), (cand, _decoded(fn, case, slots, keep)),
                         (ctrl, _decoded(fn, case, slots, torch.ones_like(keep)))):
            out.update({f"{tag}.{k}": v for k, v in got.items()})
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"kda_dim {ctx.cfg.kda_dim}, width {ctx.cfg.conv_kernel_size}; slots {SLOTS} (0 = scratch), keep {KEEP}; "
        "reference: causal_conv_varlen_torch on the decode pack, windows as its initial state"])


@register_check(
    id="kernel.conv.decode_triton", component="kernel", level="kernel", kind=Kind.BF16, devices=("cuda",),
    control="fresh rows (keep=0) convolve their stale window",
)
@builders.single_thread
def check_conv_decode_triton(ctx: CheckContext) -> Trial:
    """The registry's CUDA decode conv (Triton, one launch) vs the torch reference, bf16 activations."""
    builders.require_fast_path("Triton conv decode", conv_launch.available())
    slots = torch.tensor(SLOTS, device=ctx.device)
    keep = torch.tensor(KEEP, device=ctx.device).bfloat16()
    case = _case(ctx, torch.bfloat16)
    cand = _decoded(conv_ops.conv_decode_qkv, case, slots, keep)
    builders.assert_routed(conv_ops.CAUSAL_DECODE, backend=TRITON)
    ctrl = _decoded(conv_ops.conv_decode_qkv, case, slots, torch.ones_like(keep))
    REGISTRY.force(conv_ops.CAUSAL_DECODE, TORCH)
    try:
        ref = _decoded(conv_ops.conv_decode_qkv, case, slots, keep)
    finally:
        REGISTRY.force(conv_ops.CAUSAL_DECODE, None)
    return Trial(reference={k: v.float() for k, v in ref.items()}, candidate={k: v.float() for k, v in cand.items()},
                 control={k: v.float() for k, v in ctrl.items()}, notes=[
                     "bf16; the kernel rounds like torch after every op, only exp / division differ (a bf16 ulp "
                     "at most, on few elements); windows are copies and come back exact"])


PREFILL_LENS = [5, 1, 2, 9, 3]  # 1 and 2: shorter than the window, their final windows reach into the old one


@register_check(
    id="kernel.conv.prefill_triton", component="kernel", level="kernel", kind=Kind.BF16, devices=("cuda",),
    control="the pack's sequence boundaries erased: every conv reaches into the previous sequence",
)
@builders.single_thread
def check_conv_prefill_triton(ctx: CheckContext) -> Trial:
    """The registry's CUDA prefill convs (Triton, q/k/v in two launches) vs the torch gather conv, bf16: a pack
    of fresh and continuing sequences (initial windows scaled by keep, as the layer passes them), outputs and
    final windows."""
    builders.require_fast_path("Triton conv prefill", conv_launch.available_prefill())
    if not ctx.cfg.has_kda:
        raise SkipCheck("preset has no KDA layers")
    g, D, W, dev = ctx.generator, ctx.cfg.kda_dim, ctx.cfg.conv_kernel_size, ctx.device
    T, N = sum(PREFILL_LENS), len(PREFILL_LENS)
    b = PackedBatch.build(torch.zeros(T, dtype=torch.long), PREFILL_LENS, device=dev)
    def three(*shape: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, b_, c = ((torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(dev) for _ in range(3))
        return a, b_, c

    xs, weights = three(T, D), three(D, W, scale=0.5)
    keep = torch.tensor([1, 0, 1, 1, 0], dtype=torch.bfloat16, device=dev)[:, None, None]
    old = three(N, D, W - 1)
    inits = (old[0] * keep, old[1] * keep, old[2] * keep)

    def run(seg: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        ys, finals = conv_ops.causal_conv_qkv(xs, weights, seg, pos, b.cu_seqlens, inits)
        out = {name: y.float() for name, y in zip("qkv", ys, strict=True)}
        out.update({f"window_{name}": f.float() for name, f in zip("qkv", finals, strict=True)})
        return out

    cand = run(b.seg_ids, b.local_pos)
    builders.assert_routed(conv_ops.CAUSAL_QKV, backend=TRITON)
    ctrl = run(torch.zeros_like(b.seg_ids), torch.arange(T, device=dev))
    REGISTRY.force(conv_ops.CAUSAL_QKV, TORCH)
    try:
        ref = run(b.seg_ids, b.local_pos)
    finally:
        REGISTRY.force(conv_ops.CAUSAL_QKV, None)
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"bf16, kda_dim {D}, width {W}; sequences of {PREFILL_LENS} tokens, keep {[1, 0, 1, 1, 0]}; the kernel "
        "rounds like torch after every op, only silu's exp / division may differ by an ulp"])
