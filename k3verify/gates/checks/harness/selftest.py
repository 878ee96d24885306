"""Self-tests of the gate engine that need no model: each runs a real comparison with a real control
that must fail, through the same registry, runner and reports as every parity check. They keep the
pipeline honest from day one (a runner that cannot fail them is broken) and exercise every kind,
the instrument check and localization."""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, Trial, register_check


def _sequential_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row sums accumulated left to right in `dtype` (torch.sum is pairwise/vectorized instead)."""
    acc = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
    for j in range(x.shape[1]):
        acc = acc + x[:, j].to(dtype)
    return acc


@register_check(
    id="gates.selftest.fp32_sum_order", component="gates", level="module", kind=Kind.RMS,
    noise="the sequential sum in fp32 vs fp64",
    control="accumulate the same sums in a bf16 accumulator",
)
def check_fp32_sum_order(ctx: CheckContext) -> Trial:
    # B rows, N terms; a positive mean makes the bf16 accumulator stagnate, which the control relies on.
    x = (torch.randn(64, 1024, generator=ctx.generator) + 1.0).to(ctx.device)
    reference, gold = _sequential_sum(x, torch.float32), _sequential_sum(x.double(), torch.float64)
    return Trial(
        reference=reference,
        candidate=x.sum(dim=1),
        control=_sequential_sum(x, torch.bfloat16).float(),
        gold=gold, noise=(reference, gold),
        notes=["sequential vs pairwise fp32 summation of the same numbers"],
    )


def _pack(seqs: list[torch.Tensor], offsets: list[int], total: int) -> torch.Tensor:
    # Preallocated with NaN so any row the packer fails to write shows up instead of hiding as zero.
    out = torch.full((total, seqs[0].shape[1]), float("nan"), dtype=seqs[0].dtype, device=seqs[0].device)
    for seq, start in zip(seqs, offsets, strict=True):
        out[start:start + seq.shape[0]] = seq
    return out


@register_check(
    id="gates.selftest.bitexact_pack", component="gates", level="module", kind=Kind.BITEXACT,
    control="cu_seqlens shifted by one row, so one row is never written",
)
def check_bitexact_pack(ctx: CheckContext) -> Trial:
    lengths = [7, 1, 12, 4, 9]  # ragged on purpose, including a length-1 sequence
    seqs = [torch.randn(n, 48, generator=ctx.generator).to(ctx.device, torch.bfloat16) for n in lengths]
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    total = cu[-1]
    return Trial(
        reference=torch.cat(seqs),
        candidate=_pack(seqs, cu[:-1], total),
        control=_pack(seqs, [0, *[c + 1 for c in cu[1:-1]]][: len(seqs)], total + 1)[:total],
    )


@register_check(
    id="gates.selftest.bf16_linear", component="gates", level="module", kind=Kind.BF16,
    control="input features rolled by one (a weight loaded with shifted columns)",
)
def check_bf16_linear(ctx: CheckContext) -> Trial:
    a = torch.randn(48, 256, generator=ctx.generator).to(ctx.device, torch.bfloat16)
    w = (torch.randn(64, 256, generator=ctx.generator) / 16).to(ctx.device, torch.bfloat16)
    return Trial(
        reference=(a.float() @ w.float().T).to(torch.bfloat16),
        candidate=torch.nn.functional.linear(a, w),
        control=torch.nn.functional.linear(a, w.roll(1, dims=1)),
        gold=a.double() @ w.double().T,
        position_dim=0,
    )


def _stack(h: torch.Tensor, weights: list[torch.Tensor], *, broadcast: bool, drop_residual_at: int | None = None
           ) -> list[torch.Tensor]:
    """Residual tanh layers; returns every layer's output (T tokens x D). `broadcast` computes the
    projection as multiply-then-sum, a different reduction order from the GEMM: small real errors."""
    outs = []
    for i, w in enumerate(weights):
        y = (h[:, None, :] * w[None, :, :]).sum(-1) if broadcast else h @ w.T
        h = 0.5 * torch.tanh(y) + (0.0 if i == drop_residual_at else h)
        outs.append(h)
    return outs


@register_check(
    id="gates.selftest.layer_stack", component="gates", level="model", kind=Kind.RMS,
    noise="the GEMM stack in fp32 vs fp64",
    control="residual connection dropped at layer 3",
)
def check_layer_stack(ctx: CheckContext) -> Trial:
    t, d, n_layers = 32, 64, 6
    x = torch.randn(t, d, generator=ctx.generator).to(ctx.device)
    weights = [(torch.randn(d, d, generator=ctx.generator) / d**0.5).to(ctx.device) for _ in range(n_layers)]
    ref = _stack(x, weights, broadcast=False)
    cand = _stack(x, weights, broadcast=True)
    ctrl = _stack(x, weights, broadcast=True, drop_residual_at=3)
    gold = _stack(x.double(), [w.double() for w in weights], broadcast=False)
    names = [f"layers.{i}" for i in range(n_layers)]
    return Trial(
        reference=ref[-1], candidate=cand[-1], control=ctrl[-1], gold=gold[-1], noise=(ref[-1], gold[-1]),
        layers=list(zip(names, ref, cand, strict=True)), position_dim=0,
        control_layers=list(zip(names, ref, ctrl, strict=True)),
    )
