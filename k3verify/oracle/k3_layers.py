"""The reference's layer modules. Attribute paths equal checkpoint names, so the strict loader fills
them with one loop. Every forward takes ONE sequence x [T, H] (no batch dim) and returns [T, H].

Constants public implementations disagree on are read through `active.current(knob, released)` at forward time
(oracle/conventions.py names the knobs), so a cached model computes with whatever conventions are applied.
"""

from __future__ import annotations

import torch
from torch import nn

from k3verify.config import ModelConfig
from k3verify.oracle import active, fla_ref, rounding
from k3verify.oracle import functional as Fn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # NaN-filled: a tensor the loader forgot to fill poisons every output instead of hiding as zeros.
    return nn.Parameter(torch.full(shape, float("nan"), dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """Bias-free projection, weight [out, in]."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(n_out, n_in, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.linear(x, self.weight)


class RMSNorm(nn.Module):
    """`eps` is the released value; `knob` names the convention that may replace it at forward time."""

    def __init__(self, n: int, eps: float, dtype: torch.dtype, knob: str | None = None) -> None:
        super().__init__()
        self.weight = _param(n, dtype=dtype)
        self.eps, self.knob = eps, knob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.rms_norm(x, self.weight, self.eps if self.knob is None else active.current(self.knob, self.eps))


class WeightOnly(nn.Module):
    """A holder for one `weight` consumed by the parent (conv kernels, gated-norm gains, res projections)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(*shape, dtype=dtype)


class GLU(nn.Module):
    """gate_proj / up_proj / down_proj with SiLU (Kimi-Linear) or SiTU (K3)."""

    def __init__(self, cfg: ModelConfig, hidden: int, inter: int, dtype: torch.dtype,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        self._names = names
        for name, (n_in, n_out) in zip(names, ((hidden, inter), (hidden, inter), (inter, hidden)), strict=True):
            setattr(self, name, Linear(n_in, n_out, dtype))
        self.act, self.beta, self.linear_beta = cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n).weight for n in self._names)
        if self.act == "situ":
            if self.beta is None or self.linear_beta is None:
                raise ValueError("hidden_act 'situ' needs situ_beta and situ_linear_beta in the config")
            return Fn.situ_glu(x, gate, up, down, self.beta, self.linear_beta)
        return Fn.silu_glu(x, gate, up, down)


class Expert(GLU):
    """A routed expert: w1 gate, w3 up, w2 down (dense; MXFP4 checkpoints are dequantized into it).

    Knob `moe.expert_activations`: "exact", or "q8_0": the inputs of all three matmuls rounded to Q8_0 blocks,
    as llama.cpp's CPU path multiplies MXFP4 weights (oracle/precision.py's w4a8-q8act)."""

    def __init__(self, cfg: ModelConfig, width: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, width, inter, dtype, names=("w1", "w3", "w2"))

    def forward(self, x: torch.Tensor, site: tuple[int, int, torch.Tensor] | None = None) -> torch.Tensor:
        """`site`: (MoE layer index, expert index, token positions of x's rows [n]), which names the emulated
        roundings (oracle/rounding.py); without it they are named as layer -1, tokens 0..n-1."""
        mode = active.current("moe.expert_activations", "exact")
        if mode == "exact":
            return super().forward(x)
        if mode != "q8_0":
            raise ValueError(f"moe.expert_activations must be 'exact' or 'q8_0'; got {mode!r}")
        layer, expert, positions = site if site is not None else (-1, -1, torch.arange(x.shape[0]))
        tokens = positions.tolist()
        w1, w3, w2 = (getattr(self, n).weight for n in self._names)
        x = rounding.q8_0_round(x, layer, rounding.INPUT, expert, tokens)
        gate, up = Fn.linear(x, w1), Fn.linear(x, w3)
        if self.act == "situ":
            if self.beta is None or self.linear_beta is None:
                raise ValueError("hidden_act 'situ' needs situ_beta and situ_linear_beta in the config")
            h = Fn.situ(gate, up, self.beta, self.linear_beta)
        else:
            h = torch.nn.functional.silu(gate) * up
        return Fn.linear(rounding.q8_0_round(h, layer, rounding.DOWN, expert, tokens), w2)


class Router(nn.Module):
    """`block_sparse_moe.gate`: weight [E, H], e_score_correction_bias [E]. Held in at least fp32, as transformers
    keeps them (`_keep_in_fp32_modules_strict`): an fp32 checkpoint's router is not rounded to bf16."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        self.weight = _param(cfg.num_experts, cfg.hidden_size, dtype=wide)
        self.e_score_correction_bias = _param(cfg.num_experts, dtype=wide)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k] fp32, topk_idx [T, k] int64 ascending per token)."""
        c = self.cfg
        return Fn.router(x, self.weight, self.e_score_correction_bias, c.num_experts_per_token, c.num_expert_group,
                         c.topk_group, c.moe_renormalize, c.routed_scaling_factor,
                         renorm_eps=active.current("router.renorm_eps", Fn.RENORM_EPS),
                         scaling_at=active.current("router.scaling", "after_renorm"))


class SparseMoE(nn.Module):
    """`block_sparse_moe`: router, routed experts (latent for K3), shared experts."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int = -1) -> None:
        super().__init__()
        H, N = cfg.hidden_size, cfg.expert_in_dim
        self.layer = layer  # names its emulated roundings (oracle/rounding.py)
        self.gate = Router(cfg, dtype)
        self.experts = nn.ModuleList(Expert(cfg, N, cfg.moe_intermediate_size, dtype) for _ in range(cfg.num_experts))
        self.shared_experts = GLU(cfg, H, cfg.shared_intermediate_size, dtype)
        self.latent = cfg.uses_latent_moe
        if self.latent:
            self.routed_expert_down_proj = Linear(H, N, dtype)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(N, cfg.rms_norm_eps, dtype)
            self.routed_expert_up_proj = Linear(N, H, dtype)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)  # the router reads the hidden x, also for LatentMoE
        norm = getattr(self, "routed_expert_norm", None)
        return Fn.sparse_moe(
            x, weights, idx, lambda e, h, tokens: self.experts[e](h, (self.layer, e, tokens)), self.shared_experts,
            latent_down=self.routed_expert_down_proj.weight if self.latent else None,
            latent_norm=norm.weight if norm is not None else None,
            latent_up=self.routed_expert_up_proj.weight if self.latent else None,
            eps=active.current("moe.latent_norm_eps", self.eps),
            combine_in_activation=active.in_activation("moe.combine_precision"))


class KDA(nn.Module):
    """Kimi Delta Attention (SPEC §3); the recurrence is fla's naive_recurrent_kda (own fp64 loop in fp64)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        H, D, dk, W, heads = cfg.hidden_size, cfg.kda_dim, cfg.kda_head_dim, cfg.conv_kernel_size, cfg.kda_num_heads
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", Linear(H, D, dtype))
            setattr(self, f"{name}_conv1d", WeightOnly(D, 1, W, dtype=dtype))
        # Stored width: K3 pads A_log to a power of two ([128] for 96 heads); only [:heads] is read.
        self.A_log = _param(*((cfg.a_log_width,) if cfg.is_k3 else (1, 1, heads, 1)), dtype=dtype)
        self.f_a_proj, self.f_b_proj = Linear(H, dk, dtype), Linear(dk, D, dtype)
        self.dt_bias = _param(D, dtype=dtype)
        self.b_proj = Linear(H, heads, dtype)
        if cfg.use_full_rank_gate:
            self.g_proj = Linear(H, D, dtype)
        else:
            self.g_a_proj, self.g_b_proj = Linear(H, dk, dtype), Linear(dk, D, dtype)
        self.o_norm = WeightOnly(dk, dtype=dtype)
        self.o_proj = Linear(D, H, dtype)
        self.heads, self.head_dim, self.lower_bound, self.eps = heads, dk, cfg.gate_lower_bound, cfg.rms_norm_eps

    def _conv_branch(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """`{name}_proj` then its causal depthwise conv `{name}_conv1d` (set up by name in __init__)."""
        proj, conv = self.get_submodule(f"{name}_proj"), self.get_submodule(f"{name}_conv1d")
        return Fn.causal_conv(proj(x), conv.get_parameter("weight"), active.current("kda.conv_activation", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, h, dk = x.shape[0], self.heads, self.head_dim
        l2_eps = active.current("kda.l2norm_eps", Fn.L2NORM_EPS)
        q = Fn.l2norm(self._conv_branch("q", x).view(T, h, dk), l2_eps)
        k = Fn.l2norm(self._conv_branch("k", x).view(T, h, dk), l2_eps)
        v = self._conv_branch("v", x).view(T, h, dk)
        raw = self.f_b_proj(self.f_a_proj(x)).view(T, h, dk)  # no activation between f_a and f_b
        a_log = self.A_log.reshape(-1)[:h]
        gate_form = active.current("kda.gate", "plain" if self.lower_bound is None else "safe")
        if gate_form == "plain":
            g = Fn.kda_forget_gate_plain(raw, a_log, self.dt_bias)
        elif gate_form == "safe" and self.lower_bound is not None:
            g = Fn.kda_forget_gate_safe(raw, a_log, self.dt_bias, self.lower_bound)
        else:
            raise ValueError(f"kda.gate {gate_form!r} needs 'plain', or 'safe' with a gate_lower_bound in the config "
                             f"(this one has {self.lower_bound})")
        beta = torch.sigmoid(Fn.hi(self.b_proj(x)))  # [T, h], applied exactly once
        o = self.core(q, k, v, g, beta)  # [T, h, dk]
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = Fn.gated_rms_norm(o, gate.view(T, h, dk), self.o_norm.weight, active.current("kda.o_norm_eps", self.eps))
        return self.o_proj(o.reshape(T, h * dk))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> torch.Tensor:
        """q, k, g [T, h, dk]; v [T, h, dv]; beta [T, h] -> o [T, h, dv] in v's dtype."""
        scale = self.head_dim ** -0.5
        if v.dtype == torch.float64:  # fla's naive rounds everything to fp32; keep fp64 end to end
            return Fn.recurrent_kda(q, k, v, g, beta, scale)
        o, _ = fla_ref.naive_recurrent(q[None], k[None], v[None], g[None], beta[None], scale=scale)
        return o[0]


class MLA(nn.Module):
    """Multi-head latent attention, no rotary, optional K3 output gate (SPEC §4)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        H, nh, dq = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(H, nh * dq, dtype)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = WeightOnly(cfg.q_lora_rank, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * dq, dtype)
        self.kv_a_proj_with_mqa = Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype)
        self.kv_a_layernorm = WeightOnly(cfg.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype)
        self.o_proj = Linear(nh * cfg.v_head_dim, H, dtype)
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(H, nh * cfg.v_head_dim, dtype)
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg

        def w(name: str) -> torch.Tensor | None:
            mod = getattr(self, name, None)
            return None if mod is None else mod.weight

        def need(name: str) -> torch.Tensor:
            weight = w(name)
            if weight is None:
                raise ValueError(f"MLA layer has no {name}")
            return weight

        return Fn.mla(x, heads=c.num_attention_heads, qk_nope=c.qk_nope_head_dim, qk_rope=c.qk_rope_head_dim,
                      v_dim=c.v_head_dim, kv_lora_rank=c.kv_lora_rank, kv_a_proj=need("kv_a_proj_with_mqa"),
                      kv_a_norm=need("kv_a_layernorm"), kv_b_proj=need("kv_b_proj"), o_proj=need("o_proj"),
                      q_proj=w("q_proj"), q_a_proj=w("q_a_proj"), q_a_norm=w("q_a_layernorm"),
                      q_b_proj=w("q_b_proj"), g_proj=w("g_proj"),
                      q_a_eps=active.current("mla.q_a_norm_eps", Fn.MLA_LORA_EPS),
                      kv_a_eps=active.current("mla.kv_a_norm_eps", Fn.MLA_LORA_EPS),
                      softmax_in_activation=active.in_activation("mla.softmax_precision"))
