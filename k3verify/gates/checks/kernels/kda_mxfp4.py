"""Serving kernels vs independent references: the MXFP4 decode, the torch KDA recurrence (chunked
prefill and one-token decode) vs fla's naive KDA, and on CUDA fla's Triton KDA. The fused Triton norms,
router and SDPA attention fast paths are in serving_fastpath_kernels.py."""

from __future__ import annotations

import torch

from k3verify.checkpoint import mxfp4 as ckpt_mxfp4
from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched
from k3verify.kernels import kda as kda_ops
from k3verify.kernels.kda import fla_launch
from k3verify.kernels.kda import torch_ref as kda_ref
from k3verify.kernels.mxfp4 import torch_ref as mxfp4_ref
from k3verify.kernels.registry import REGISTRY, TORCH, TRITON
from k3verify.kernels.varlen import DeviceSeqlens
from k3verify.oracle import fla_ref
from k3verify.oracle import functional as Fn
from k3verify.serving.layers.moe import PackedWeight, SparseMoE

LENS = [63, 130, 1]  # off the 64 grid, a ragged multi-chunk sequence and a single token
H, DK, DV = 3, 24, 20  # odd widths, dv != dk


def _high_nibble_first(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed >> 4, packed & 0x0F), dim=-1).flatten(-2)


@register_check(
    id="kernel.mxfp4.dequant", component="kernel", level="kernel", kind=Kind.BITEXACT,
    control="codes read high nibble first",
)
@builders.single_thread
def check_mxfp4_dequant(ctx: CheckContext) -> Trial:
    if not ctx.cfg.experts_quantized:
        raise SkipCheck("preset has no MXFP4 experts")
    model = builders.serving_model(ctx)
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    per_use = builders.serving_model(ctx, mxfp4_mode="per_use")
    moe_pu = next(m for m in per_use.modules() if isinstance(m, SparseMoE))
    group = ctx.cfg.mxfp4_group_size
    ref, cand, ctrl = {}, {}, {}
    for e, expert in enumerate(moe.experts):
        for name in ("w1", "w2", "w3"):
            w: PackedWeight = getattr(expert, name)
            key = f"expert{e}.{name}"
            ref[key] = ckpt_mxfp4.dequantize(w.weight_packed, w.weight_scale, torch.float32, group)
            cand[key] = w.dense(torch.float32)
            with patched(mxfp4_ref, "codes_low_first", _high_nibble_first):
                ctrl[key] = w.dense(torch.float32)
        for slot, name in enumerate(("w1", "w3", "w2")):  # what the experts actually multiply by, both modes
            ref[f"expert{e}.{name}.cached"] = ref[f"expert{e}.{name}"]
            cand[f"expert{e}.{name}.cached"] = moe.expert_weights(e)[slot]
            ref[f"expert{e}.{name}.per_use"] = ref[f"expert{e}.{name}"]
            cand[f"expert{e}.{name}.per_use"] = moe_pu.expert_weights(e)[slot]
            ctrl[f"expert{e}.{name}.cached"] = ctrl[f"expert{e}.{name}"]
            ctrl[f"expert{e}.{name}.per_use"] = ctrl[f"expert{e}.{name}"]
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"{len(moe.experts)} experts of the first MoE layer; reference: checkpoint/mxfp4.dequantize; also the "
        "dense weights the experts use in mxfp4_mode='cached' and 'per_use'"])


def _kda_inputs(ctx: CheckContext, T: int, n_seq: int) -> dict[str, torch.Tensor]:
    g = ctx.generator
    raw = torch.randn(T, H, DK, generator=g)
    return {
        "q": torch.randn(T, H, DK, generator=g), "k": torch.randn(T, H, DK, generator=g),
        "v": torch.randn(T, H, DV, generator=g),
        "g": -5.0 * torch.sigmoid(2.0 * raw),  # the K3 safe-gate range [-5, 0)
        "beta": torch.sigmoid(torch.randn(T, H, generator=g)),
        "s0": torch.randn(n_seq, H, DK, DV, generator=g) * 0.5,
    }


def _naive(x: dict[str, torch.Tensor], cu: list[int], beta: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's naive_recurrent_kda per sequence (normalized inputs, as its contract wants)."""

    q, k = Fn.l2norm(x["q"]), Fn.l2norm(x["k"])
    b = x["beta"] if beta is None else beta
    outs, finals = [], []
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        o, S = fla_ref.naive_recurrent(q[None, s:e], k[None, s:e], x["v"][None, s:e], x["g"][None, s:e],
                                       b[None, s:e], scale=DK**-0.5, initial_state=x["s0"][n:n + 1],
                                       output_final_state=True)
        if S is None:
            raise RuntimeError("fla's naive_recurrent returned no final state despite output_final_state=True")
        outs.append(o[0])
        finals.append(S[0])
    return torch.cat(outs), torch.stack(finals)


def _gold(x: dict[str, torch.Tensor], cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token in fp64 (our own step on fp64 inputs)."""
    d = {k: v.double() for k, v in x.items()}
    outs, finals = [], []
    for n in range(len(cu) - 1):
        S = d["s0"][n:n + 1]
        for t in range(cu[n], cu[n + 1]):
            o, S = kda_ref.kda_decode_torch(d["q"][t:t + 1], d["k"][t:t + 1], d["v"][t:t + 1], d["g"][t:t + 1],
                                            d["beta"][t:t + 1], S, DK**-0.5)
            outs.append(o[0])
        finals.append(S[0])
    return torch.stack(outs), torch.stack(finals)


@register_check(
    id="kernel.kda.prefill", component="kernel", level="kernel", kind=Kind.RMS,
    noise="fla's naive recurrence in fp32 vs the same recurrence in fp64, same inputs",
    control="beta dropped (beta = 1)",
)
@builders.single_thread
def check_kda_prefill_kernel(ctx: CheckContext) -> Trial:
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    x = _kda_inputs(ctx, cu[-1], len(LENS))
    o_ref, s_ref = _naive(x, cu)
    o, s = kda_ref.kda_prefill_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, x["s0"], DK**-0.5)
    o_bad, s_bad = kda_ref.kda_prefill_torch(x["q"], x["k"], x["v"], x["g"], torch.ones_like(x["beta"]), cu, x["s0"],
                                             DK**-0.5)
    o_gold, s_gold = _gold(x, cu)
    ref, gold = {"o": o_ref, "state": s_ref}, {"o": o_gold, "state": s_gold}
    return Trial(reference=ref, candidate={"o": o, "state": s}, noise=(ref, gold),
                 control={"o": o_bad, "state": s_bad}, gold=gold, position_dim=0,
                 notes=[f"lengths {LENS}, {H} heads, dk {DK}, dv {DV}, random initial states; gold: fp64 token loop"])


@register_check(
    id="kernel.kda.decode", component="kernel", level="kernel", kind=Kind.RMS,
    noise="fla's naive recurrence in fp32 vs the same step in fp64, same inputs",
    control="state not decayed before the update (g ignored)",
)
@builders.single_thread
def check_kda_decode_kernel(ctx: CheckContext) -> Trial:
    B = 5
    x = _kda_inputs(ctx, B, B)
    o_ref, s_ref = _naive(x, list(range(B + 1)))
    o, s = kda_ref.kda_decode_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"], DK**-0.5)
    o_bad, s_bad = kda_ref.kda_decode_torch(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]), x["beta"], x["s0"],
                                            DK**-0.5)
    ref, (o_gold, s_gold) = {"o": o_ref, "state": s_ref}, _gold(x, list(range(B + 1)))
    return Trial(reference=ref, candidate={"o": o, "state": s}, noise=(ref, {"o": o_gold, "state": s_gold}),
                 control={"o": o_bad, "state": s_bad}, notes=[f"{B} sequences, one token each, from random states"])


@register_check(
    id="kernel.kda.triton_vs_torch", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=5e-3,
    bar_reason="fla's own bar for its Triton KDA against a torch reference; bf16 q/k/v with in-kernel products "
    "in reduced precision, which the noise of one reference in bf16 vs fp64 does not describe (CUDA only, "
    "not measured on CPU)",
    control="beta squashed twice before the Triton kernel",
)
@builders.single_thread
def check_kda_triton(ctx: CheckContext) -> Trial:
    """fla's chunk_kda (through our registry) vs the torch path, bf16 inputs: a pack of three sequences (fla's
    varlen call), its second sequence alone (the dense call fla_launch makes for one sequence), and the pack as a
    static pack with an empty trailing sequence (fla's graph-capturable `use_graph` mode; the empty sequence's
    final state is not compared: fla leaves it undefined)."""
    builders.require_fast_path("Triton KDA path", fla_launch.available())
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    x = {k: v.to(ctx.device) for k, v in _kda_inputs(ctx, cu[-1], len(LENS)).items()}
    bf = {k: (v.bfloat16() if k in ("q", "k", "v") else v) for k, v in x.items()}
    one = slice(cu[1], cu[2])

    def run(beta: torch.Tensor) -> dict[str, torch.Tensor]:
        o, state = kda_ops.kda_prefill(bf["q"], bf["k"], bf["v"], x["g"], beta, cu, x["s0"], DK**-0.5,
                                       lower_bound=-5.0)
        o1, state1 = kda_ops.kda_prefill(bf["q"][one], bf["k"][one], bf["v"][one], x["g"][one], beta[one],
                                         [0, LENS[1]], x["s0"][1:2], DK**-0.5, lower_bound=-5.0)
        # the same pack as a static (CUDA-graph) pack: offsets on the device, one empty trailing sequence
        static = DeviceSeqlens(torch.tensor([*cu, cu[-1]], device=ctx.device), cu[-1], max(LENS))
        s0 = torch.cat([x["s0"], torch.zeros_like(x["s0"][:1])])
        o2, state2 = kda_ops.kda_prefill(bf["q"], bf["k"], bf["v"], x["g"], beta, static, s0, DK**-0.5,
                                         lower_bound=-5.0)
        return {"o": o.float(), "state": state, "o_alone": o1.float(), "state_alone": state1,
                "o_static": o2.float(), "state_static": state2[:len(LENS)]}

    cand = run(x["beta"])
    builders.assert_routed(kda_ops.PREFILL, backend=TRITON)
    builders.assert_routed(kda_ops.PREFILL_STATIC, backend=TRITON)
    ctrl = run(torch.sigmoid(x["beta"]))
    REGISTRY.force(kda_ops.PREFILL, TORCH)
    REGISTRY.force(kda_ops.PREFILL_STATIC, TORCH)
    try:
        ref = run(x["beta"])
    finally:
        REGISTRY.force(kda_ops.PREFILL, None)
        REGISTRY.force(kda_ops.PREFILL_STATIC, None)
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"bf16 q/k/v, fp32 gate/beta/state; fla's bar; sequences of {LENS} tokens packed, and the {LENS[1]}-token "
        "one alone, and the pack with its offsets on the device (static)"])


@register_check(
    id="kernel.kda.decode_slots_triton", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=5e-3,
    bar_reason="fla's own bar for its Triton KDA against a torch reference; bf16 q/k/v with in-kernel products "
    "in reduced precision, which the noise of one reference in bf16 vs fp64 does not describe (CUDA only, "
    "not measured on CPU)",
    control="beta squashed twice before the Triton kernel",
)
@builders.single_thread
def check_kda_decode_slots_triton(ctx: CheckContext) -> Trial:
    """The serving decode: fla's fused_recurrent_kda reading/writing states in the pool by slot, in
    place, vs the torch path (gather, step, scatter). Rows out of slot order; untouched slots must
    stay as they were (they are part of the compared state)."""
    builders.require_fast_path("Triton KDA path", fla_launch.available())
    B, n_slots = 5, 9
    x = {k: v.to(ctx.device) for k, v in _kda_inputs(ctx, B, n_slots).items()}
    slots = torch.tensor([7, 2, 5, 1, 8], device=ctx.device)
    bf = {k: (v.bfloat16() if k in ("q", "k", "v") else v) for k, v in x.items()}

    def run(backend: str | None, beta: torch.Tensor) -> dict[str, torch.Tensor]:
        pool = x["s0"].clone()
        REGISTRY.force(kda_ops.DECODE_SLOTS, backend)
        try:
            o = kda_ops.kda_decode_slots(bf["q"], bf["k"], bf["v"], x["g"], beta, pool, slots, DK**-0.5)
        finally:
            REGISTRY.force(kda_ops.DECODE_SLOTS, None)
        return {"o": o.float(), "pool": pool}

    cand = run(None, x["beta"])
    builders.assert_routed(kda_ops.DECODE_SLOTS, backend=TRITON)
    return Trial(reference=run(TORCH, x["beta"]), candidate=cand, control=run(None, torch.sigmoid(x["beta"])),
                 notes=[f"{B} rows on slots {slots.tolist()} of a {n_slots}-slot pool; bf16 q/k/v, fp32 state"])


@register_check(
    id="kernel.kda.decode_gated_triton", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=5e-3,
    bar_reason="fla's own bar for its Triton KDA against a torch reference; bf16 q/k/v and gate input, the gate and "
    "beta's sigmoid computed in-kernel in fp32 with fla's exp / softplus (CUDA only, not measured on CPU)",
    control="beta squashed before the kernel, which squashes it again",
)
@builders.single_thread
def check_kda_decode_gated_triton(ctx: CheckContext) -> Trial:
    """The serving decode as the layer calls it: fla's fused_recurrent_kda making the forget gate (plain and safe)
    and beta's sigmoid from their raw inputs in-kernel, states in the pool by slot, vs the torch path (kda_forget_gate,
    kda_beta, gather, step, scatter). Rows out of slot order; untouched slots are part of the compared state."""
    builders.require_fast_path("Triton KDA path", fla_launch.available())
    B, n_slots = 5, 9
    x = {k: v.to(ctx.device) for k, v in _kda_inputs(ctx, B, n_slots).items()}
    g = ctx.generator
    raw = {"f": (torch.randn(B, H * DK, generator=g) * 3.0).to(ctx.device, torch.bfloat16),
           "dt_bias": torch.randn(H * DK, generator=g).to(ctx.device),
           "a_log": (torch.randn(H, generator=g) * 0.5).to(ctx.device),
           "b": torch.randn(B, H, generator=g).to(ctx.device, torch.bfloat16)}
    slots = torch.tensor([7, 2, 5, 1, 8], device=ctx.device)
    bf = {k: x[k].bfloat16() for k in ("q", "k", "v")}

    def run(backend: str | None, b_logits: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, bound in (("plain", None), ("safe", -5.0)):
            pool = x["s0"].clone()
            REGISTRY.force(kda_ops.DECODE_SLOTS_GATED, backend)
            try:
                o = kda_ops.kda_decode_slots_gated(bf["q"], bf["k"], bf["v"], raw["f"], raw["dt_bias"], raw["a_log"],
                                                   b_logits, pool, slots, DK**-0.5, bound)
            finally:
                REGISTRY.force(kda_ops.DECODE_SLOTS_GATED, None)
            out[f"{name}.o"], out[f"{name}.pool"] = o.float(), pool
        return out

    cand = run(None, raw["b"])
    builders.assert_routed(kda_ops.DECODE_SLOTS_GATED, backend=TRITON)
    return Trial(reference=run(TORCH, raw["b"]), candidate=cand,
                 control=run(None, torch.sigmoid(raw["b"].float()).bfloat16()),
                 notes=[f"{B} rows on slots {slots.tolist()} of a {n_slots}-slot pool; bf16 q/k/v and gate input, "
                        "fp32 state; the plain gate and a safe gate at -5"])


@register_check(
    id="kernel.kda.gate_beta_triton", component="kernel", level="kernel", kind=Kind.RMS, devices=("cuda",),
    bar=1e-5,
    bar_reason="the same fp32 arithmetic as torch's kda_forget_gate / kda_beta with Triton's exp and log (a few ulps): "
    "1.2e-8 to 1.7e-8 under the interpreter on CPU (tests/kernels/test_kernels_kda_forget_gate.py); far below any gate "
    "fault (a dropped bias moves it 0.1)",
    control="beta squashed before the kernel, which squashes it again",
)
@builders.single_thread
def check_kda_forget_gate_beta_triton(ctx: CheckContext) -> Trial:
    """The prefill / score gate as the layer calls it: one Triton launch making the forget gate (plain and safe)
    and beta from f_b_proj's output and b_proj's logits, both column slices of one wider row (the fused projection
    GEMM's layout), vs the torch path (kda_forget_gate, kda_beta). Inputs span softplus' threshold both ways."""
    g = ctx.generator
    T, width = 7, 2 * H * DK + H + 5
    row = (torch.randn(T, width, generator=g) * 3.0)
    row[0, :H * DK] = torch.linspace(-30.0, 30.0, H * DK)
    row = row.to(ctx.device, torch.bfloat16)
    f, b = row[:, :H * DK], row[:, 2 * H * DK:2 * H * DK + H]
    dt_bias = torch.randn(H * DK, generator=g).to(ctx.device)
    A = (torch.randn(H, generator=g) * 0.5).exp()[:, None].to(ctx.device)

    def run(backend: str | None, b_logits: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, bound in (("plain", None), ("safe", -5.0)):
            REGISTRY.force(kda_ops.FORGET_GATE_BETA, backend)
            try:
                out[f"{name}.g"], out[f"{name}.beta"] = kda_ops.kda_forget_gate_beta(f, dt_bias, A, b_logits, H, bound)
            finally:
                REGISTRY.force(kda_ops.FORGET_GATE_BETA, None)
        return out

    cand = run(None, b)
    builders.assert_routed(kda_ops.FORGET_GATE_BETA, backend=TRITON)
    ctrl_b = torch.sigmoid(b.float()).bfloat16()
    return Trial(reference=run(TORCH, b), candidate=cand, control=run(None, ctrl_b),
                 notes=[f"{T} tokens, {H} heads x {DK}; bf16 inputs as strided column slices; the plain gate and a "
                        "safe gate at -5"])
