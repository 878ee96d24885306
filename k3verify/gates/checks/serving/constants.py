"""Every config-dependent constant, module by module: the serving module against the oracle's module
built from the config, in fp32 (bit for bit: the op order is the oracle's) and in bf16.

A constant that one module reads differently from the config (a norm eps, the SiTU betas, the gate's
lower bound) moves whole-model logits by far less than a model-level bar, so each site is held here on
inputs where the constant matters: half the rows at unit scale, half at the scale where eps is
comparable to mean(x^2); SiTU inputs deep in both tanh caps; gate inputs spanning the sigmoid. The bf16
norm check is bit for bit too: a norm whose reduction runs in bf16 changes bits that a per-element bf16
bar would forgive. The routed scaling factor is held by router.module.* (bit for bit against the
oracle router, both dtypes) and the depth mixer by attn_res.module.*.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from k3verify.gates import CheckContext, Kind, SkipCheck, Trial, register_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.patch import patched
from k3verify.kernels import norm as norm_ops
from k3verify.oracle import functional as Fn
from k3verify.serving.layers.mlp import situ_glu

ROWS = 32  # per scale
F32, BF16 = torch.float32, torch.bfloat16
@dataclass(frozen=True)
class NormSite:
    """One RMSNorm site: the serving module, the oracle's computation and its eps, and the eps the control
    swaps in (the other family's)."""

    name: str
    serving: Any  # an RMSNorm module (its .eps is what the control swaps)
    oracle: Callable[[torch.Tensor], torch.Tensor]
    eps: float
    wrong_eps: float


def _scaled_rows(ctx: CheckContext, width: int, eps: float, dtype: torch.dtype, lead: tuple[int, ...] = ()
                 ) -> torch.Tensor:
    """[2 ROWS, *lead, width]: ROWS at unit scale, ROWS with mean(x^2) ~ eps (where eps is half the norm)."""
    x = torch.randn(2 * ROWS, *lead, width, generator=ctx.generator)
    x[ROWS:] *= math.sqrt(eps)
    return x.to(dtype).to(ctx.device)


def _norm_sites(ctx: CheckContext, dtype: torch.dtype) -> list[NormSite]:
    cfg, model, ref = ctx.cfg, builders.serving_model(ctx, dtype), builders.reference_model(ctx, dtype)
    layer_eps, lora_eps = cfg.rms_norm_eps, Fn.MLA_LORA_EPS
    sites = [NormSite("norm", model.model.norm, ref.model.norm, ref.model.norm.eps, lora_eps)]
    for i, (layer, ref_layer) in enumerate(zip(builders.layers(model), builders.layers(ref), strict=True)):
        for name in ("input_layernorm", "post_attention_layernorm"):
            oracle = getattr(ref_layer, name)
            sites.append(NormSite(f"layers.{i}.{name}", getattr(layer, name), oracle, oracle.eps, lora_eps))
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            if hasattr(layer.self_attn, name):
                w = getattr(ref_layer.self_attn, name).weight
                sites.append(NormSite(f"layers.{i}.self_attn.{name}", getattr(layer.self_attn, name),
                                      functools.partial(Fn.rms_norm, weight=w, eps=lora_eps), lora_eps, layer_eps))
        if hasattr(getattr(layer, "block_sparse_moe", None), "routed_expert_norm"):
            oracle = ref_layer.block_sparse_moe.routed_expert_norm
            sites.append(NormSite(f"layers.{i}.block_sparse_moe.routed_expert_norm",
                                  layer.block_sparse_moe.routed_expert_norm, oracle, oracle.eps, lora_eps))
    return sites


def _norm_trial(ctx: CheckContext, dtype: torch.dtype) -> Trial:
    ref, cand, ctrl = {}, {}, {}
    for site in _norm_sites(ctx, dtype):
        x = _scaled_rows(ctx, site.serving.weight.numel(), site.eps, dtype)
        ref[site.name], cand[site.name] = site.oracle(x), site.serving(x)
        with patched(site.serving, "eps", site.wrong_eps):
            ctrl[site.name] = site.serving(x)
    cfg, model, oracle_model = ctx.cfg, builders.serving_model(ctx, dtype), builders.reference_model(ctx, dtype)
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    for i in cfg.kda_layers:  # the gated o_norm, per head
        o_norm, ref_attn = builders.layers(model)[i].self_attn.o_norm, builders.layers(oracle_model)[i].self_attn
        x = _scaled_rows(ctx, dk, ref_attn.eps, dtype, (h,))
        gate = (torch.randn(x.shape, generator=ctx.generator) * 2).to(dtype).to(ctx.device)
        key = f"layers.{i}.self_attn.o_norm"
        ref[key] = Fn.gated_rms_norm(x, gate, ref_attn.o_norm.weight, ref_attn.eps)
        cand[key] = o_norm(x, gate)
        with patched(o_norm, "eps", Fn.MLA_LORA_EPS):
            ctrl[key] = o_norm(x, gate)
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"{len(ref)} norm sites, {dtype}: {ROWS} rows at unit scale and {ROWS} with mean(x^2) ~ the oracle's eps; "
        f"oracle eps: layer norms {cfg.rms_norm_eps:g}, MLA LoRA norms {Fn.MLA_LORA_EPS:g}"])


_NORM_CONTROL = "every norm site at the other family's eps (layer norms 1e-6, the MLA LoRA norms the layer eps)"


@register_check(id="norm.sites.fp32", component="norm", level="module", kind=Kind.BITEXACT, control=_NORM_CONTROL)
@builders.single_thread
@builders.torch_path(norm_ops.RMS, norm_ops.GATED_RMS)
def check_norm_sites_fp32(ctx: CheckContext) -> Trial:
    return _norm_trial(ctx, F32)


@register_check(id="norm.sites.bf16", component="norm", level="module", kind=Kind.BITEXACT, suites=("full",),
                control=_NORM_CONTROL)
@builders.single_thread
@builders.torch_path(norm_ops.RMS, norm_ops.GATED_RMS)
def check_norm_sites_bf16(ctx: CheckContext) -> Trial:
    trial = _norm_trial(ctx, BF16)
    trial.notes.append("bit for bit in bf16, not the per-element bf16 bar: the serving norm takes the oracle's op "
                       "order (fp32 reduction, one cast), and a reduction done in bf16 moves bits within 2 ulps")
    return trial


def _act_sites(ctx: CheckContext, dtype: torch.dtype) -> list[tuple[str, Any, Any]]:
    """(name, serving module holding `.act`, oracle GLU with the config's activation constants)."""
    model, ref = builders.serving_model(ctx, dtype), builders.reference_model(ctx, dtype)
    sites = []
    for i, (layer, ref_layer) in enumerate(zip(builders.layers(model), builders.layers(ref), strict=True)):
        if not layer.is_moe:
            sites.append((f"layers.{i}.mlp", layer.mlp, ref_layer.mlp))
            continue
        moe, ref_moe = layer.block_sparse_moe, ref_layer.block_sparse_moe
        sites.append((f"layers.{i}.experts", moe, ref_moe.experts[0]))
        sites.append((f"layers.{i}.shared_experts", moe.shared_experts, ref_moe.shared_experts))
    return sites


def _oracle_act(glu: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if glu.act == "situ":
        return Fn.situ(g, u, glu.beta, glu.linear_beta)
    return F.silu(g) * u


def _act_trial(ctx: CheckContext, dtype: torch.dtype) -> Trial:
    cfg = ctx.cfg
    if cfg.hidden_act == "situ":
        assert cfg.situ_beta is not None
        beta, lin = cfg.situ_beta, cfg.situ_linear_beta

        def wrong(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # the two betas read from each other's key
            return situ_glu(g, u, lin if lin is not None else beta, beta)
    else:
        def wrong(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            return situ_glu(g, u, 4.0, 25.0)
    ref, cand, ctrl = {}, {}, {}
    for name, serving, glu in _act_sites(ctx, dtype):
        # half the rows near 0, half deep in the caps: |g| / beta and |u| / beta_lin reach 2-5
        g, u = (torch.randn(2 * ROWS, 64, generator=ctx.generator) for _ in range(2))
        g[ROWS:] *= 12.0
        u[ROWS:] *= 80.0
        g, u = g.to(dtype).to(ctx.device), u.to(dtype).to(ctx.device)
        ref[name], cand[name] = _oracle_act(glu, g, u), serving.act(g, u)
        with patched(serving, "act", wrong):
            ctrl[name] = serving.act(g, u)
    return Trial(reference=ref, candidate=cand, control=ctrl, notes=[
        f"{len(ref)} activation sites (dense MLP, routed experts, shared experts), {dtype}, hidden_act "
        f"{cfg.hidden_act!r}, betas {cfg.situ_beta} / {cfg.situ_linear_beta}; each module's own `act`"])


_ACT_CONTROL = "SiTU with beta and beta_lin read from each other's key (SiLU presets: SiTU(4, 25) for SiLU)"


@register_check(id="mlp.act.fp32", component="mlp", level="module", kind=Kind.BITEXACT, control=_ACT_CONTROL)
@builders.single_thread
def check_act_fp32(ctx: CheckContext) -> Trial:
    return _act_trial(ctx, F32)


@register_check(id="mlp.act.bf16", component="mlp", level="module", kind=Kind.BF16, suites=("full",),
                control=_ACT_CONTROL)
@builders.single_thread
def check_act_bf16(ctx: CheckContext) -> Trial:
    return _act_trial(ctx, BF16)


def _forget_gate_trial(ctx: CheckContext, dtype: torch.dtype) -> Trial:
    cfg = ctx.cfg
    if not cfg.has_kda:
        raise SkipCheck("preset has no KDA layers")
    model, ref = builders.serving_model(ctx, dtype), builders.reference_model(ctx, dtype)
    wrong = -5.0 if cfg.gate_lower_bound is None else 0.8 * cfg.gate_lower_bound
    out: dict[str, dict[str, torch.Tensor]] = {"ref": {}, "cand": {}, "ctrl": {}}
    for i in cfg.kda_layers:
        attn, ref_attn = builders.layers(model)[i].self_attn, builders.layers(ref)[i].self_attn
        x = builders.layer_inputs(ctx, 2 * ROWS, dtype)
        x[ROWS:] *= 4  # pushes exp(A) (f_b f_a x + dt_bias) across the whole sigmoid (or softplus) range
        T, h, dk = x.shape[0], cfg.kda_num_heads, cfg.kda_head_dim
        raw = ref_attn.f_b_proj(ref_attn.f_a_proj(x)).view(T, h, dk)
        a_log = ref_attn.A_log.reshape(-1)[:h]
        key = f"layers.{i}"
        out["ref"][key] = (Fn.kda_forget_gate_plain(raw, a_log, ref_attn.dt_bias) if ref_attn.lower_bound is None
                           else Fn.kda_forget_gate_safe(raw, a_log, ref_attn.dt_bias, ref_attn.lower_bound))
        out["cand"][key] = attn.forget_gate(attn.f_a_proj(x))  # the layer hands the gate f_a_proj(x)
        with patched(attn, "lower_bound", wrong):
            out["ctrl"][key] = attn.forget_gate(attn.f_a_proj(x))
    return Trial(reference=out["ref"], candidate=out["cand"], control=out["ctrl"], notes=[
        f"{len(cfg.kda_layers)} KDA forget gates, {dtype}; gate_lower_bound {cfg.gate_lower_bound}; control: "
        f"lower bound {wrong}"])


_GATE_CONTROL = "the safe gate's lower bound at 0.8x the config's (plain-gate presets: a safe gate at -5)"


@register_check(id="kda.gate.fp32", component="kda", level="module", kind=Kind.BITEXACT, control=_GATE_CONTROL)
@builders.single_thread
def check_forget_gate_fp32(ctx: CheckContext) -> Trial:
    return _forget_gate_trial(ctx, F32)


@register_check(id="kda.gate.bf16", component="kda", level="module", kind=Kind.BF16, suites=("full",),
                control=_GATE_CONTROL)
@builders.single_thread
def check_forget_gate_bf16(ctx: CheckContext) -> Trial:
    return _forget_gate_trial(ctx, BF16)
