"""CUDA fast paths vs the torch path they replace, each through the kernel registry: the fused Triton RMSNorm /
gated RMSNorm, the fused Triton router selection, and MLA prefill attention through torch's SDPA."""

from __future__ import annotations

import torch

from k3verify.gates import CheckContext, Kind, Trial, compare, register_check
from k3verify.gates.shared import builders
from k3verify.kernels import attn as attn_ops
from k3verify.kernels import norm as norm_ops
from k3verify.kernels import router as router_ops
from k3verify.kernels.attn import sdpa as attn_sdpa
from k3verify.kernels.attn import torch_ref as attn_ref
from k3verify.kernels.norm import norm_launch as norm_triton
from k3verify.kernels.norm import torch_ref as norm_ref
from k3verify.kernels.registry import CUDA, TRITON
from k3verify.kernels.router import select_launch as router_triton
from k3verify.kernels.router import torch_ref as router_ref

NORM_WIDTHS = (72, 2304, 7168)  # ragged vs the power-of-two block, a K3 KDA width, the K3 hidden size
NORM_ROWS = 37


@register_check(
    id="kernel.norm.triton_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-3, bar_reason="same roundings, other reduction order and rsqrt: rare one-ulp bf16 flips (CPU "
    "interpreter: RMSNorm bit-identical, gated <= 1.2e-4); the weight applied before the cast gives ~3e-3, no eps >0.1",
    control="RMSNorm with its weight applied before the cast to bf16; gated RMSNorm without eps",
)
def check_norm_triton(ctx: CheckContext) -> Trial:
    """The fused Triton RMSNorm / gated RMSNorm (through our registry) vs the torch path, bf16 activations
    over rows whose scales span 4.5 decades (the smallest below sqrt(eps))."""
    builders.require_fast_path("Triton norm path", norm_triton.available())
    ref, cand, ctrl = {}, {}, {}
    g = ctx.generator
    for W in NORM_WIDTHS:
        scale = 10 ** (torch.rand(NORM_ROWS, 1, generator=g) * 4.5 - 3.5)
        x = (torch.randn(NORM_ROWS, W, generator=g) * scale).bfloat16().to(ctx.device)
        gate = (torch.randn(NORM_ROWS, W, generator=g) * 4).bfloat16().to(ctx.device)
        w = torch.randn(W, generator=g).bfloat16().to(ctx.device)
        gw = torch.randn(W, generator=g).to(ctx.device)
        cand[f"rms.W{W}"] = norm_ops.rms_norm(x, w, ctx.cfg.rms_norm_eps)
        cand[f"gated.W{W}"] = norm_ops.gated_rms_norm(x, gate, gw, ctx.cfg.rms_norm_eps)
        builders.assert_routed(norm_ops.RMS, norm_ops.GATED_RMS, backend=TRITON)
        ctrl[f"rms.W{W}"] = norm_triton.rms_norm_triton(x.float(), w.float(), ctx.cfg.rms_norm_eps).bfloat16()
        ctrl[f"gated.W{W}"] = norm_triton.gated_rms_norm_triton(x, gate, gw, 0.0)
        ref[f"rms.W{W}"] = norm_ref.rms_norm_torch(x, w, ctx.cfg.rms_norm_eps)
        ref[f"gated.W{W}"] = norm_ref.gated_rms_norm_torch(x, gate, gw, ctx.cfg.rms_norm_eps)
    as_f32 = {k: v.float() for k, v in ref.items()}
    return Trial(reference=as_f32, candidate={k: v.float() for k, v in cand.items()},
                 control={k: v.float() for k, v in ctrl.items()},
                 notes=[f"{NORM_ROWS} rows x widths {NORM_WIDTHS}, bf16 x / gate, bf16 RMSNorm weight, fp32 gated "
                        f"weight, eps {ctx.cfg.rms_norm_eps}"])


@register_check(
    id="kernel.norm.add_rms_triton", component="kernel", level="kernel", kind=Kind.BITEXACT, devices=("cuda",),
    control="the norm taken of x alone (the residual stored in the sum but left out of the norm)",
)
def check_norm_add_triton(ctx: CheckContext) -> Trial:
    """The residual add fused into the RMSNorm (norm.add_rms through our registry) writes the bits of the add
    followed by the Triton RMSNorm: the sum and the normed row, bf16 activations over 4.5 decades of row scale,
    bf16 and fp32 weights (the fused kernel repeats the RMSNorm kernel's arithmetic on the rounded sum)."""
    builders.require_fast_path("Triton norm path", norm_triton.available())
    ref, cand, ctrl = {}, {}, {}
    g = ctx.generator
    for W in NORM_WIDTHS:
        scale = 10 ** (torch.rand(NORM_ROWS, 1, generator=g) * 4.5 - 3.5)
        x = (torch.randn(NORM_ROWS, W, generator=g) * scale).bfloat16().to(ctx.device)
        r = (torch.randn(NORM_ROWS, W, generator=g) * scale).bfloat16().to(ctx.device)
        for wname, w in (("w_bf16", torch.randn(W, generator=g).bfloat16()), ("w_fp32", torch.randn(W, generator=g))):
            w = w.to(ctx.device)
            key = f"W{W}.{wname}"
            s, y = norm_ops.add_rms_norm(x, r, w, ctx.cfg.rms_norm_eps)
            builders.assert_routed(norm_ops.ADD_RMS, backend=TRITON)
            cand[f"{key}.sum"], cand[f"{key}.norm"] = s.float(), y.float()
            ref[f"{key}.sum"] = (x + r).float()
            ref[f"{key}.norm"] = norm_triton.rms_norm_triton(x + r, w, ctx.cfg.rms_norm_eps).float()
            ctrl[f"{key}.sum"] = ref[f"{key}.sum"]
            ctrl[f"{key}.norm"] = norm_triton.rms_norm_triton(x, w, ctx.cfg.rms_norm_eps).float()
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"{NORM_ROWS} rows x widths {NORM_WIDTHS}, bf16 x and residual, bf16 and fp32 weights, eps "
        f"{ctx.cfg.rms_norm_eps}; reference: torch's add, then the Triton RMSNorm"])


ROUTER_TOKENS = 257


def _dense_routing(weights: torch.Tensor, idx: torch.Tensor, E: int) -> torch.Tensor:
    """(weights [T, k], ids [T, k]) -> [T, E] with each token's weights at its experts, zeros elsewhere: an
    id that differs moves a whole weight, so the RMS comparison sees it far above the rounding of the weights."""
    return torch.zeros(weights.shape[0], E, dtype=torch.float32, device=weights.device).scatter_(1, idx, weights)


@register_check(
    id="kernel.router.triton_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-5, bar_reason="same ids, weights to rounding (Triton's exp and division; CPU interpreter <= 3.3e-7 "
    "relative per weight, 7e-8 RMS); one flipped id among the T x k moves a whole weight (> 1e-2) and shifts "
    "the ids by > 4e-5 RMS",
    control="experts chosen without the correction bias (the Triton kernel given a zero bias)",
)
def check_router_triton(ctx: CheckContext) -> Trial:
    """The fused Triton router selection (through our registry) vs the torch path on ungrouped routing, as
    [T, E] routing matrices plus the [T, k] ids in their order: the preset's (E, top_k, renormalize, scaling)
    plus K3-sized shapes."""
    builders.require_fast_path("Triton router path", router_triton.available())
    cfg, g = ctx.cfg, ctx.generator
    shapes = {(cfg.num_experts, cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor),
              (256, 8, True, 2.5), (896, 16, True, 2.5), (64, 16, False, 1.0)}
    ref, cand, ctrl = {}, {}, {}
    mismatched_rows = 0
    for E, k, renormalize, scaling in sorted(shapes):
        logits = (torch.randn(ROUTER_TOKENS, E, generator=g) * 3).to(ctx.device)
        bias = (torch.randn(E, generator=g) * 0.5).to(ctx.device)
        key = f"E{E}.k{k}.renorm{int(renormalize)}"
        w, idx = router_ops.route(logits, bias, k, 1, 1, renormalize, scaling)
        builders.assert_routed(router_ops.SELECT, backend=TRITON)
        ref_w, ref_idx = router_ref.route_torch(logits, bias, k, 1, 1, renormalize, scaling)
        mismatched_rows += int((idx != ref_idx).any(dim=-1).sum())
        ctrl_w, ctrl_idx = router_triton.route_triton(logits, torch.zeros_like(bias), k, 1, 1, renormalize, scaling)
        cand[key], ref[key], ctrl[key] = (_dense_routing(a, b, E) for a, b in ((w, idx), (ref_w, ref_idx),
                                                                               (ctrl_w, ctrl_idx)))
        # the ids themselves, in order: the dense matrix cannot see ids emitted out of ascending order
        cand[f"{key}.ids"], ref[f"{key}.ids"], ctrl[f"{key}.ids"] = idx.float(), ref_idx.float(), ctrl_idx.float()
    return Trial(reference=ref, candidate=cand, control=ctrl,
                 notes=[f"{ROUTER_TOKENS} tokens x (E, top_k, renormalize) {sorted(s[:3] for s in shapes)}, "
                        f"fp32 logits; {mismatched_rows} token(s) with other expert ids than the torch path"])


@register_check(
    id="kernel.attn.sdpa_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-2, bar_reason="bf16 inputs and output against fp64: measured on CPU, eager bf16 attention sits "
    "4-5e-3 from fp64 and SDPA 3e-3; a mask one key late sits above 0.19",
    control="the causal mask one key late (each query also sees the next key)",
)
@builders.single_thread
def check_attn_sdpa(ctx: CheckContext) -> Trial:
    """MLA prefill attention through the registry on CUDA (torch's fused SDPA; MLA's value head dim
    differs from the key's) vs the eager reference in fp64: fresh sequences and a continuation over a
    cached prefix."""
    g = ctx.generator
    ref, cand, ctrl, eager = {}, {}, {}, {}
    for Lq, offset in ((80, 0), (33, 17), (1, 40)):
        h, d, dv = 5, 18, 10
        q, k, v = (torch.randn(h, n, w, generator=g) for n, w in ((Lq, d), (offset + Lq, d), (offset + Lq, dv)))
        scale = d**-0.5
        bq, bk, bv = (t.bfloat16().to(ctx.device) for t in (q, k, v))
        key = f"Lq{Lq}.offset{offset}"
        cand[key] = attn_ops.causal_attention(bq, bk, bv, offset, scale).float().cpu()
        builders.assert_routed(attn_ops.CAUSAL, backend=CUDA)
        ref[key] = attn_ref.causal_attention(q.double(), k.double(), v.double(), offset, scale).float()
        late = offset + 1 if Lq > 1 else offset  # one query sees every key anyway: the control needs Lq > 1
        ctrl[key] = attn_sdpa.causal_attention_sdpa(bq, bk, bv, late, scale).float().cpu()
        eager[key] = compare(Kind.RMS, ref[key], attn_ref.causal_attention(bq, bk, bv, offset, scale).float().cpu(),
                             1.0).metric
    return Trial(reference=ref, candidate=cand, control=ctrl, metrics={f"eager_bf16_rms.{k}": m for k, m in
                                                                      eager.items()},
                 notes=["h 5, dk 18, dv 10; fresh 80 tokens, 33 after a 17-token prefix, 1 after 40"])
