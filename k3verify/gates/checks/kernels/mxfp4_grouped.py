"""The packed MXFP4 expert path: the grouped GEMM that reads E2M1 codes + E8M0 scales as stored (Triton on
CUDA) against its torch reference, and the serving MoE layers in mxfp4_mode "packed" against the same
layers on dequantized experts ("cached", the reference mode)."""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, compare, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched
from k3verify.kernels import mxfp4 as mxfp4_ops
from k3verify.kernels.moe.grouped import PackedExperts
from k3verify.kernels.mxfp4 import grouped_launch as mxfp4_triton
from k3verify.kernels.mxfp4 import torch_ref as mxfp4_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON
from k3verify.serving.layers.decoder import DecoderLayer
from k3verify.serving.layers.moe import SparseMoE
from k3verify.serving.model import ServingModel

GROUP = 32
REFERENCE_NOISE = 1.66e-3  # torch path in bf16 vs its fp64 evaluation, these inputs, CPU (see the bar)
# (name, rows per expert, N, K): decode (one to three rows per routed expert, zero-row experts between),
# a mid-size batch and a prefill; K3's latent 3584 and intermediate 3072 as K, ragged N
CASES = (
    ("decode", (1, 0, 0, 2, 1, 1, 0, 3, 1, 1, 1, 0, 2, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0, 1), 512, 3584),
    ("mid", (40, 40, 40, 40, 0, 39, 41, 1), 816, 3072),
    ("prefill", (700, 0, 1, 333, 129, 0, 900, 17), 1072, 3072),
)


def swap_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """The bytes a decoder reading the high nibble first would see as low-first."""
    return ((codes & 0x0F) << 4) | (codes >> 4)


def _random_case(ctx: CheckContext, counts: tuple[int, ...], N: int, K: int) -> tuple[torch.Tensor, ...]:
    """x [M, K] bf16, every byte value among the codes, scales over 2^-9..2^3 so a group boundary, a scale
    bias or a nibble order that is off moves the result far past the bar."""
    g, E = ctx.generator, len(counts)
    x = torch.randn(sum(counts), K, generator=g).bfloat16()
    codes = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 131, (E, N, K // GROUP), generator=g, dtype=torch.uint8)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return tuple(t.to(ctx.device) for t in (x, codes, scales, offs))


def _preset_cases(ctx: CheckContext) -> dict[str, tuple[torch.Tensor, ...]]:
    """The preset's first MoE layer as served packed (its real codes and scales), 37 tokens routed
    top-k over its experts."""
    model = builders.serving_model(ctx, torch.bfloat16, mxfp4_mode="packed")
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    p: PackedExperts = moe.packed_experts()
    E, k = moe.num_experts, ctx.cfg.num_experts_per_token
    ids = torch.stack([torch.randperm(E, generator=ctx.generator)[:k] for _ in range(37)]).reshape(-1)
    offs = torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32).to(ctx.device)
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, codes, scales in (("preset.w13", p.w13_codes, p.w13_scales), ("preset.w2", p.w2_codes, p.w2_scales)):
        x = torch.randn(ids.numel(), codes.shape[2] * 2, generator=ctx.generator).bfloat16().to(ctx.device)
        out[name] = (x, codes, scales, offs)
    return out


@register_check(
    id="kernel.mxfp4.grouped_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=3.3e-3, bar_reason="2x the reference's own noise: the torch path (dequantize + bf16 GEMM) sits 1.66e-3 "
    "from its fp64 evaluation on these inputs (CPU; the bf16 rounding of the output), recorded in-run as "
    "reference_noise; codes read high nibble first sit at 1.41, a scale exponent off by one at 1.0",
    control="codes read high nibble first (the Triton kernel given nibble-swapped bytes)",
)
def check_mxfp4_grouped(ctx: CheckContext) -> Trial:
    """The Triton MXFP4 grouped GEMM (through the registry) vs the torch reference evaluated in fp64, on
    decode, mid and prefill row counts (experts with zero rows, ragged N, K3's K) and on the preset's own
    experts (when it has MXFP4 experts)."""
    builders.require_fast_path("Triton MXFP4 grouped GEMM", mxfp4_triton.available())
    cases = {name: _random_case(ctx, counts, N, K) for name, counts, N, K in CASES}
    if ctx.cfg.experts_quantized:
        cases |= _preset_cases(ctx)
    ref, cand, ctrl, metrics = {}, {}, {}, {}
    for name, (x, codes, scales, offs) in cases.items():
        cand[name] = mxfp4_ops.grouped_mm(x, codes, scales, offs, GROUP).float()
        builders.assert_routed(mxfp4_ops.GROUPED_MM, backend=TRITON)
        ctrl[name] = mxfp4_triton.grouped_mm_triton(x, swap_nibbles(codes), scales, offs, GROUP).float()
        ref[name] = mxfp4_ref.grouped_mm_torch(x.double(), codes, scales, offs, GROUP)
        torch_bf16 = mxfp4_ref.grouped_mm_torch(x, codes, scales, offs, GROUP)  # the registry's torch path
        metrics[f"reference_noise.{name}"] = compare(Kind.RMS, ref[name], torch_bf16, 1.0).metric
        metrics[f"triton_vs_torch_bf16.{name}"] = compare(Kind.RMS, torch_bf16, cand[name], 1.0).metric
        metrics[f"bf16_elementwise_fail_fraction.{name}"] = compare(Kind.BF16, ref[name], cand[name]).metric
    metrics["reference_noise"] = max(v for k, v in metrics.items() if k.startswith("reference_noise."))
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics=metrics, notes=[
        f"row counts per expert {[c for _, c, _, _ in CASES]}, N x K {[(n, k) for *_, n, k in CASES]}, group "
        f"{GROUP}, random codes and scales 2^-9..2^3; plus the preset's first MoE layer (w13, w2) over 37 tokens; "
        f"bar derived from a reference noise of {REFERENCE_NOISE} (this run's: see metrics)"])


def _moe_layers(model: ServingModel) -> dict[int, tuple[torch.nn.Module, SparseMoE]]:
    """Layer index -> (its post-attention norm, its MoE) for every MoE layer of a ServingModel."""
    out: dict[int, tuple[torch.nn.Module, SparseMoE]] = {}
    layers: list[torch.nn.Module] = list(model.get_submodule("model.layers").children())
    for i, layer in enumerate(layers):
        if isinstance(layer, DecoderLayer) and isinstance(layer.ffn_module, SparseMoE):
            out[i] = (layer.post_attention_layernorm, layer.ffn_module)
    return out


@register_check(
    id="moe.module.packed", component="moe", level="module", kind=Kind.RMS, bar=1e-2,
    bar_reason="bf16 packed vs bf16 dequantized experts: the same products, each GEMM output rounded to bf16 "
    "once per path (CPU torch paths: identical, 0); independent roundings at both GEMMs propagate to ~3e-3; "
    "nibble-swapped codes sit above 0.79",
    control="the packed experts' codes read high nibble first",
)
@builders.single_thread
def check_moe_packed(ctx: CheckContext) -> Trial:
    """Every MoE layer of the preset in mxfp4_mode "packed" (codes + scales stacked, the MXFP4 grouped GEMM:
    Triton on CUDA, its torch reference on CPU) vs the same layer on dequantized experts ("cached"), bf16,
    on hidden states through the layer's own pre-norm. Refuses to compare unless the packed op ran on the
    device's path."""
    if not ctx.cfg.experts_quantized:
        raise SkipCheck("preset has no MXFP4 experts")
    packed = builders.serving_model(ctx, torch.bfloat16, mxfp4_mode="packed")
    cached = builders.serving_model(ctx, torch.bfloat16, mxfp4_mode="cached")
    backend = TRITON if ctx.device.type == "cuda" else TORCH
    ref, cand, ctrl, low, high = {}, {}, {}, {}, {}
    reference_layers = _moe_layers(cached)
    oracle = builders.layers(builders.reference_model(ctx, torch.bfloat16))
    oracle64 = builders.layers(builders.reference_model(ctx, torch.float64))
    for i, (_, moe) in _moe_layers(packed).items():
        norm, reference = reference_layers[i]
        x = norm(builders.layer_inputs(ctx, 80, torch.bfloat16))
        key = f"layers.{i}"
        ref[key] = reference(x)
        REGISTRY.last_backend.pop(mxfp4_ops.GROUPED_MM, None)
        cand[key] = moe(x)
        builders.assert_routed(mxfp4_ops.GROUPED_MM, backend=backend)
        p = moe.packed_experts()
        swapped = PackedExperts(swap_nibbles(p.w13_codes), p.w13_scales, swap_nibbles(p.w2_codes), p.w2_scales,
                                p.group)
        with patched(moe, "packed_experts", lambda swapped=swapped: swapped):
            ctrl[key] = moe(x)
        low[key], high[key] = oracle[i].ffn(x), oracle64[i].ffn(x.double())  # the fixed bar's noise, for the report
    return Trial(reference=ref, candidate=cand, control=ctrl, position_dim=0, noise=(low, high),
                 notes=[f"{len(ref)} MoE layer(s), T=80, bf16; packed op on {backend}"])
