"""Serving router, norms and the block attention-residual mix vs the oracle's formulas."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates import fixtures as fx
from k3verify.gates.route_pin import tensor_attr
from k3verify.kernels import norm as norm_ops
from k3verify.kernels import router as router_ops
from k3verify.oracle import functional as Fn
from k3verify.serving.layers import attn_res
from k3verify.serving.layers.attn_res import attn_res_mix, num_blocks

T_ROUTER = 256


def _router_trial(ctx: CheckContext, dtype: torch.dtype) -> Trial:
    """The checkpoint's routers; if its correction biases flip no selection (a fresh transformers init holds
    zeros), the control could not differ, so the same routers run again with a drawn bias in both stacks."""
    layers = [i for i in range(ctx.cfg.num_hidden_layers) if ctx.cfg.is_moe_layer(i)]
    if not layers:
        raise SkipCheck("preset has no MoE layers")
    trial = _router_pass(ctx, dtype, layers, synthetic_bias=False)
    if all(torch.equal(trial.candidate[k], trial.control[k]) for k in trial.candidate if k.endswith(".idx")):
        trial = _router_pass(ctx, dtype, layers, synthetic_bias=True)
        trial.notes.append("the checkpoint's correction biases flip no expert selection on these inputs, so the "
                           "control could not differ: both stacks ran with a drawn bias N(0, 0.1) instead")
    return trial


def _router_pass(ctx: CheckContext, dtype: torch.dtype, layers: list[int], synthetic_bias: bool) -> Trial:
    ref, model = fx.reference_model(ctx, dtype), fx.serving_model(ctx, dtype)
    out: dict[str, dict[str, torch.Tensor]] = {"ref": {}, "cand": {}, "ctrl": {}}
    for i in layers:
        norm = ref.get_submodule(f"model.layers.{i}.post_attention_layernorm")
        x = norm(torch.randn(T_ROUTER, ctx.cfg.hidden_size, generator=ctx.generator).to(dtype).to(ctx.device))
        oracle = ref.get_submodule(f"model.layers.{i}.block_sparse_moe.gate")
        serving = model.get_submodule(f"model.layers.{i}.block_sparse_moe.gate")
        bias = torch.randn(ctx.cfg.num_experts, generator=ctx.generator) * 0.1 if synthetic_bias else None
        with _bias(oracle, bias), _bias(serving, bias):
            for name, res in (("ref", oracle(x)), ("cand", serving(x))):
                out[name][f"layers.{i}.weights"], out[name][f"layers.{i}.idx"] = res
        zeros = nn.Parameter(torch.zeros_like(tensor_attr(serving, "e_score_correction_bias")), requires_grad=False)
        with fx.patched(serving, "e_score_correction_bias", zeros):
            out["ctrl"][f"layers.{i}.weights"], out["ctrl"][f"layers.{i}.idx"] = serving(x)
    notes = [f"{len(layers)} router(s), {T_ROUTER} tokens, {dtype}; groups {ctx.cfg.num_expert_group} / "
             f"topk_group {ctx.cfg.topk_group}"]
    return Trial(reference=out["ref"], candidate=out["cand"], control=out["ctrl"], notes=notes)


def _bias(router: nn.Module, bias: torch.Tensor | None) -> contextlib.AbstractContextManager[None]:
    if bias is None:
        return contextlib.nullcontext()
    old = tensor_attr(router, "e_score_correction_bias")
    value = nn.Parameter(bias.to(dtype=old.dtype, device=old.device), requires_grad=False)
    return fx.patched(router, "e_score_correction_bias", value)


_ROUTER_CONTROL = "experts chosen without the correction bias"


@register_check(id="router.module.fp32", component="router", level="module", kind=Kind.BITEXACT,
                control=_ROUTER_CONTROL)
@fx.single_thread
@fx.torch_path(router_ops.SELECT)
def check_router_fp32(ctx: CheckContext) -> Trial:
    return _router_trial(ctx, torch.float32)


@register_check(id="router.module.bf16", component="router", level="module", kind=Kind.BITEXACT, suites=("full",),
                control=_ROUTER_CONTROL)
@fx.single_thread
@fx.torch_path(router_ops.SELECT)
def check_router_bf16(ctx: CheckContext) -> Trial:
    return _router_trial(ctx, torch.bfloat16)




@register_check(
    id="norm.module", component="norm", level="module", kind=Kind.BITEXACT,
    control="every norm at the other eps (1e-6 for layer norms, the layer eps for the MLA LoRA norms)",
)
@fx.single_thread
@fx.torch_path(norm_ops.RMS, norm_ops.GATED_RMS)
def check_norms(ctx: CheckContext) -> Trial:
    """Final RMSNorm, an MLA LoRA norm and a KDA gated o_norm, in fp32 and bf16, on inputs small
    enough (rms ~3e-3) that the eps shows; the torch norm path on every device."""
    cfg = ctx.cfg
    ref_out: dict[str, torch.Tensor] = {}
    cand: dict[str, torch.Tensor] = {}
    ctrl: dict[str, torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, tag = fx.serving_model(ctx, dtype), str(dtype).removeprefix("torch.")
        norms: list[tuple[str, nn.Module, float]] = [("final_norm", model.model.norm, 1e-6)]
        if cfg.has_mla:
            norms.append(("kv_a_layernorm", model.model.layers[cfg.full_attn_layers[0]].self_attn.kv_a_layernorm,
                          cfg.rms_norm_eps))
        for name, norm, wrong_eps in norms:
            x = (torch.randn(64, norm.weight.numel(), generator=ctx.generator) * 3e-3).to(dtype).to(ctx.device)
            key = f"{name}.{tag}"
            ref_out[key] = Fn.rms_norm(x, norm.weight, norm.eps)
            cand[key] = norm(x)
            with fx.patched(norm, "eps", wrong_eps):
                ctrl[key] = norm(x)
        if cfg.has_kda:
            o_norm = model.model.layers[cfg.kda_layers[0]].self_attn.o_norm
            h, dk = cfg.kda_num_heads, cfg.kda_head_dim
            x = (torch.randn(64, h, dk, generator=ctx.generator) * 3e-3).to(dtype).to(ctx.device)
            gate = (torch.randn(64, h, dk, generator=ctx.generator) * 2).to(dtype).to(ctx.device)
            key = f"o_norm.{tag}"
            ref_out[key] = Fn.gated_rms_norm(x, gate, o_norm.weight, o_norm.eps)
            cand[key] = o_norm(x, gate)
            with fx.patched(o_norm, "eps", 1e-6):
                ctrl[key] = o_norm(x, gate)
    return Trial(reference=ref_out, candidate=cand, control=ctrl,
                 notes=["oracle functional.rms_norm / gated_rms_norm with the serving module's own weight and eps"])


def _attn_res_trial(ctx: CheckContext, dtype: torch.dtype) -> Trial:
    cfg = ctx.cfg
    if not cfg.uses_attn_res:
        raise SkipCheck("preset has no Block Attention Residuals")
    model, H, T = fx.serving_model(ctx, dtype), cfg.hidden_size, 48
    pairs = [(f"layers.{i}.{p}", getattr(layer, f"{p}_norm").weight, getattr(layer, f"{p}_proj").weight)
             for i, layer in enumerate(model.model.layers) for p in ("self_attention_res", "mlp_res")]
    pairs.append(("output", model.model.output_attn_res_norm.weight, model.model.output_attn_res_proj.weight))
    ref_out, cand, ctrl = {}, {}, {}
    max_n = num_blocks(cfg)
    scaled = attn_res._score
    for j, (name, nw, pw) in enumerate(pairs):
        n = 1 + j % max_n
        # sources of very different scales, as block sums are: the softmax must see all of them
        scales = torch.exp(torch.randn(n + 1, generator=ctx.generator))
        V = (torch.randn(n + 1, T, H, generator=ctx.generator) * scales[:, None, None]).to(dtype).to(ctx.device)
        blocks, p = V[:n], V[n]
        ref_out[name] = Fn.attn_res_mix(p, list(blocks), nw, pw, cfg.rms_norm_eps)
        cand[name] = attn_res_mix(p, blocks.transpose(0, 1), nw, pw, cfg.rms_norm_eps)
        with fx.patched(attn_res, "_score", lambda v, w, eps: scaled(v, w, eps) / math.sqrt(H)):
            ctrl[name] = attn_res_mix(p, blocks.transpose(0, 1), nw, pw, cfg.rms_norm_eps)
    return Trial(reference=ref_out, candidate=cand, control=ctrl,
                 notes=[f"{len(pairs)} (norm, proj) pairs with 1..{max_n} block entries, T={T}, {dtype}; "
                        "not bitexact: the score is a row reduction here, a GEMV in the oracle"])


@register_check(
    id="attn_res.module.fp32", component="attn_res", level="module", kind=Kind.RMS, bar=1e-5,
    bar_reason="same fp32 formula, scores reduced in another order: measured rel RMS ~1e-7; the scaled-score "
    "control moves it by >1e-1",
    control="scores divided by sqrt(H) (a 1/sqrt(d) the mix must not have)",
)
@fx.single_thread
def check_attn_res_fp32(ctx: CheckContext) -> Trial:
    return _attn_res_trial(ctx, torch.float32)


@register_check(
    id="attn_res.module.bf16", component="attn_res", level="module", kind=Kind.RMS, suites=("full",),
    control="scores divided by sqrt(H) (a 1/sqrt(d) the mix must not have)",
)
@fx.single_thread
def check_attn_res_bf16(ctx: CheckContext) -> Trial:
    return _attn_res_trial(ctx, torch.bfloat16)
