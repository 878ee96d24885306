"""Serving router, norms and the block attention-residual mix vs the oracle's formulas."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched
from k3verify.gates.shared.route_pin import tensor_attr
from k3verify.kernels import norm as norm_ops
from k3verify.kernels import router as router_ops
from k3verify.oracle import functional as Fn
from k3verify.serving.layers import attn_res
from k3verify.serving.layers.attn_res import ConcatBlocks, num_blocks

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
    ref, model = builders.reference_model(ctx, dtype), builders.serving_model(ctx, dtype)
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
        with patched(serving, "e_score_correction_bias", zeros):
            out["ctrl"][f"layers.{i}.weights"], out["ctrl"][f"layers.{i}.idx"] = serving(x)
    notes = [f"{len(layers)} router(s), {T_ROUTER} tokens, {dtype}; groups {ctx.cfg.num_expert_group} / "
             f"topk_group {ctx.cfg.topk_group}"]
    return Trial(reference=out["ref"], candidate=out["cand"], control=out["ctrl"], notes=notes)


def _bias(router: nn.Module, bias: torch.Tensor | None) -> contextlib.AbstractContextManager[None]:
    if bias is None:
        return contextlib.nullcontext()
    old = tensor_attr(router, "e_score_correction_bias")
    value = nn.Parameter(bias.to(dtype=old.dtype, device=old.device), requires_grad=False)
    return patched(router, "e_score_correction_bias", value)


_ROUTER_CONTROL = "experts chosen without the correction bias"


@register_check(id="router.module.fp32", component="router", level="module", kind=Kind.BITEXACT,
                control=_ROUTER_CONTROL)
@builders.single_thread
@builders.torch_path(router_ops.SELECT)
def check_router_fp32(ctx: CheckContext) -> Trial:
    return _router_trial(ctx, torch.float32)


@register_check(id="router.module.bf16", component="router", level="module", kind=Kind.BITEXACT, suites=("full",),
                control=_ROUTER_CONTROL)
@builders.single_thread
@builders.torch_path(router_ops.SELECT)
def check_router_bf16(ctx: CheckContext) -> Trial:
    return _router_trial(ctx, torch.bfloat16)




def _mix_sources(ctx: CheckContext, w: torch.Tensor, n: int, T: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """[n+1, T, H] mix inputs on which the mix's constants and precision show. Each source is a * w_hat * sqrt(H)
    + unit noise with a in [2, 4], so every score sits near sqrt(H)|w| (15-20 on the presets: one bf16 rounding
    of a score moves its alpha by ~5%) with O(1) differences between sources; magnitudes vary per source; odd
    tokens are scaled to mean(V^2) ~ eps, where the eps inside K is a third of the norm."""
    H = w.numel()
    g = ctx.generator
    w_hat = (w.float() / w.float().norm()).cpu()
    a = 2.0 + 2.0 * torch.rand(n + 1, T, 1, generator=g)
    V = (a * w_hat * math.sqrt(H) + torch.randn(n + 1, T, H, generator=g)) * torch.exp(0.5 * torch.randn(n + 1, T, 1,
                                                                                                          generator=g))
    V[:, 1::2] *= math.sqrt(eps) / 3.0
    return V.to(dtype).to(ctx.device)


MixFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p [T, H], blocks [n, T, H]) -> [T, H]


def _serving_mixes(model: Any) -> list[tuple[str, MixFn, torch.Tensor]]:
    """(site, the serving mix through its module, the site's score weight) for every mix site."""
    sites: list[tuple[str, MixFn, torch.Tensor]] = []
    for i, layer in enumerate(builders.layers(model)):
        for pair in ("self_attention_res", "mlp_res"):
            w = getattr(layer, f"{pair}_norm").weight.float() * getattr(layer, f"{pair}_proj").weight.float()
            sites.append((f"layers.{i}.{pair}", _layer_mix(layer, pair), w.reshape(-1)))
    out_w = model.model.output_attn_res_norm.weight.float() * model.model.output_attn_res_proj.weight.float()
    sites.append(("output", lambda p, b: model.finish(p, _blocks(b)), out_w.reshape(-1)))
    return sites


def _oracle_mixes(ref: Any) -> list[MixFn]:
    """The oracle's mix at the same sites, in _serving_mixes' order, with the oracle's own eps."""
    out: list[MixFn] = []
    for layer in builders.layers(ref):
        for pair in ("self_attention_res", "mlp_res"):
            out.append(_oracle_layer_mix(layer, pair))
    out.append(lambda p, b: _oracle_finish(ref, p, list(b)))
    return out


def _layer_mix(layer: Any, pair: str) -> MixFn:
    def mix(p: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = layer.mix(p, _blocks(b), pair)
        return out
    return mix


def _oracle_layer_mix(layer: Any, pair: str) -> MixFn:
    def mix(p: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = layer.mix(pair, p, list(b))
        return out
    return mix


def _blocks(entries: torch.Tensor) -> ConcatBlocks:
    blocks = ConcatBlocks()
    for e in entries:
        blocks.append(e)
    return blocks


def _oracle_finish(ref: Any, p: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
    """The oracle's last step: output mix with its own eps, then the final norm."""
    m = ref.model
    return m.norm(Fn.attn_res_mix(p, blocks, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight,
                                  ref.cfg.rms_norm_eps))


def _attn_res_trial(ctx: CheckContext, dtype: torch.dtype) -> Trial:
    cfg = ctx.cfg
    if not cfg.uses_attn_res:
        raise SkipCheck("preset has no Block Attention Residuals")
    noisy = dtype == torch.float32 and ctx.needs_noise
    golds = _oracle_mixes(builders.reference_model(ctx, torch.float64)) if noisy else None
    oracles = _oracle_mixes(builders.reference_model(ctx, dtype))
    T, max_n, scaled = 48, num_blocks(cfg), attn_res._score
    ref, cand, ctrl, gold = {}, {}, {}, {}
    for j, (name, serving, w) in enumerate(_serving_mixes(builders.serving_model(ctx, dtype))):
        n, oracle = 1 + j % max_n, oracles[j]
        V = _mix_sources(ctx, w, n, T, cfg.rms_norm_eps, dtype)
        ref[name], cand[name] = oracle(V[n], V[:n]), serving(V[n], V[:n])
        with patched(attn_res, "_score", lambda v, w, eps: scaled(v, w, eps) / math.sqrt(cfg.hidden_size)):
            ctrl[name] = serving(V[n], V[:n])
        if golds is not None:
            gold[name] = golds[j](V[n].double(), V[:n].double())
    return Trial(reference=ref, candidate=cand, control=ctrl, noise=(ref, gold) if gold else None,
                 notes=[f"{len(ref)} mix sites (each layer's two pairs through DecoderLayer.mix, the output mix "
                        f"through ServingModel.finish) with 1..{max_n} block entries, T={T}, {dtype}; the oracle's "
                        "modules and eps; not bitexact: the score is a row reduction here, a GEMV in the oracle"])


_MIX_CONTROL = "scores divided by sqrt(H) (a 1/sqrt(d) the mix must not have)"


@register_check(
    id="attn_res.module.fp32", component="attn_res", level="module", kind=Kind.RMS,
    noise="the oracle's mix sites (layer mix, output mix + final norm) in fp32 vs fp64, same inputs",
    control=_MIX_CONTROL,
)
@builders.single_thread
@builders.torch_path(norm_ops.RMS)
def check_attn_res_fp32(ctx: CheckContext) -> Trial:
    return _attn_res_trial(ctx, torch.float32)


@register_check(id="attn_res.module.bf16", component="attn_res", level="module", kind=Kind.BF16, suites=("full",),
                control=_MIX_CONTROL)
@builders.single_thread
@builders.torch_path(norm_ops.RMS)
def check_attn_res_bf16(ctx: CheckContext) -> Trial:
    trial = _attn_res_trial(ctx, torch.bfloat16)
    trial.notes.append("per element: scores near 15-20, where a softmax (or a score reduction) done in bf16 moves "
                       "alpha by several percent")
    return trial
