"""The reference maths of SPEC-K3, one plain function per formula.

Every "in fp32" of the spec is written as `hi(x)`: fp32 for bf16/fp32 inputs, fp64 for fp64
inputs, so an fp64 reference never rounds through fp32. Shapes: T tokens, H hidden, D = heads·dim.
Nothing here imports serving/ or kernels/ (tests/oracle/test_oracle_isolation.py enforces it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Constants public implementations disagree on: docs/conventions.md lists who uses what, and
# oracle/conventions.py lets the oracle compute with an alternative (read at forward time, never bound here).
L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x² + eps), not F.normalize's max(‖x‖, eps); llama.cpp: rms_norm_eps
RENORM_EPS = 1e-20  # the router's top-k renormalisation, as the released code; llama.cpp clamps the sum instead
MLA_LORA_EPS = 1e-6  # the two MLA LoRA norms, whatever rms_norm_eps says (SPEC §1); llama.cpp, vLLM: rms_norm_eps
Q8_0_BLOCK = 32  # llama.cpp's Q8_0: 32 values share one fp16 scale max|x|/127


# A weight tagged with this attribute (oracle/gguf_arith.py's `tag`) computes in a GGUF's llama.cpp arithmetic
# while that module's knob is on; the module registers how here when it is imported (a hook: this module imports
# nothing of the oracle above it). Untagged weights never consult it.
ACTIVATION_TAG = "k3v_activation"
GGUF_HOOKS: dict[str, Callable[..., Any]] = {}


def hi(x: torch.Tensor) -> torch.Tensor:
    """x in the spec's "fp32" precision: fp32, or fp64 when x is already fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in]ᵀ -> [..., out] in x's dtype (the weight is cast at the call site). A weight
    tagged with a GGUF activation format rounds x first while that arithmetic is on (oracle/gguf_arith.py)."""
    if getattr(weight, ACTIVATION_TAG, None) is not None:
        x = GGUF_HOOKS["linear_input"](x, weight)
    return x @ weight.to(x.dtype).t()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., N] -> [..., N]: normalize in fp32, cast back to x's dtype, then multiply by weight [N]."""
    h = hi(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) * weight.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA o_norm, per head: x, gate [..., dim] -> fp32 norm × fp32 weight × sigmoid(fp32 gate), cast back."""
    h = hi(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * hi(weight) * torch.sigmoid(gate.to(h.dtype))
    return h.to(x.dtype)


def silu_glu(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU [T, H] -> [T, H]: down(silu(gate(x)) * up(x)) in x's dtype."""
    return linear(F.silu(linear(x, gate_w)) * linear(x, up_w), down_w)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU gating in fp32: (β·tanh(g/β)·sigmoid(g)) · (β_lin·tanh(u/β_lin)), cast back to g's dtype.

    Without β_lin the up branch passes through unchanged."""
    gh, uh = hi(g), hi(u)
    a = beta * torch.tanh(gh / beta) * torch.sigmoid(gh)
    if linear_beta is not None:
        uh = linear_beta * torch.tanh(uh / linear_beta)
    return (a * uh).to(g.dtype)


def situ_glu(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
             beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU [T, H] -> [T, H]: down(situ(gate(x), up(x)))."""
    return linear(situ(linear(x, gate_w), linear(x, up_w), beta, linear_beta), down_w)


def kda_forget_gate_plain(g: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear forget gate in log space: g [T, h, dk] raw f_b(f_a(x)); a_log [h]; dt_bias [h·dk].

    Returns −exp(A_log[h]) · softplus(g + dt_bias) in fp32, shape [T, h, dk]."""
    heads, dk = g.shape[-2:]
    x = hi(g) + hi(dt_bias).view(heads, dk)
    return -torch.exp(hi(a_log).view(heads, 1)) * F.softplus(x)


def kda_forget_gate_safe(g: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                         lower_bound: float) -> torch.Tensor:
    """K3 "safe gate": L · sigmoid(exp(A_log[h]) · (g + dt_bias)) in fp32, in [L, 0); shapes as
    kda_forget_gate_plain."""
    heads, dk = g.shape[-2:]
    x = hi(g) + hi(dt_bias).view(heads, dk)
    return lower_bound * torch.sigmoid(torch.exp(hi(a_log).view(heads, 1)) * x)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Depthwise causal conv of ONE sequence + SiLU: x [T, D], weight [D, 1, W] or [D, W] -> [T, D].

    Left zero-pad of W−1 (the sequence start); the weight is cast to x's dtype here because K3
    ships conv weights in fp32 while activations are bf16. activation "none" skips the SiLU."""
    if activation not in ("silu", "none"):
        raise ValueError(f"causal_conv activation must be 'silu' or 'none'; got {activation!r}")
    w = weight.reshape(weight.shape[0], -1).to(x.dtype)  # [D, W]
    W = w.shape[1]
    padded = torch.cat([x.new_zeros(W - 1, x.shape[1]), x], dim=0)  # [T+W-1, D]
    out = torch.zeros_like(x)
    for j in range(W):  # tap j sees token t−(W−1−j)
        out = out + padded[j:j + x.shape[0]] * w[:, j]
    return F.silu(out) if activation == "silu" else out


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """[..., d] -> [..., d] in fp32: x / sqrt(sum(x²) + eps), eps 1e-6 as fla."""
    h = hi(x)
    return h / torch.sqrt(h.pow(2).sum(-1, keepdim=True) + eps)


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """The KDA recurrence of SPEC §3.5, written out for one sequence (used for fp64 runs and as gold).

    q, k [T, h, dk]; v [T, h, dv]; g [T, h, dk] log decay; beta [T, h]. Per token:
    S ← S·diag(exp(g_t)); S ← S + β_t·k_t ⊗ (v_t − k_tᵀS); o_t = (scale·q_t)ᵀS. Returns o [T, h, dv]
    in the inputs' high precision (fla's naive_recurrent_kda always rounds to fp32)."""
    dt = torch.promote_types(hi(q).dtype, v.dtype)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    T, heads, dk = q.shape
    S = q.new_zeros(heads, dk, v.shape[-1])
    out = v.new_zeros(v.shape)
    for t in range(T):
        S = S * torch.exp(g[t])[..., None]
        pred = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, S)
    return out


def router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int, topk_group: int,
           renormalize: bool, scaling: float, renorm_eps: float = RENORM_EPS,
           scaling_at: str = "after_renorm") -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with correction bias: x [T, H] -> (weights [T, k] fp32, idx [T, k] int64).

    Logits x·Wᵀ in fp32; s = sigmoid; choose top-k of s + bias (restricted to the best `topk_group`
    groups, scored by the sum of their two best biased scores as in noaux_tc, when num_groups >
    topk_group); weights are the UNcorrected s; renormalize /(sum + 1e-20) when top_k > 1; × scaling.
    `scaling_at` places the scaling: "after_renorm" (the released code), "before_renorm" or "none".
    Indices are sorted ascending per token so that two implementations can be compared."""
    if scaling_at not in ("after_renorm", "before_renorm", "none"):
        raise ValueError(f"router scaling_at must be after_renorm, before_renorm or none; got {scaling_at!r}")
    logits = hi(x) @ hi(weight).t()  # [T, E]
    s = torch.sigmoid(logits)
    choice = s + hi(bias)
    T, E = choice.shape
    if num_groups > topk_group:
        per_group = choice.view(T, num_groups, E // num_groups)
        group_score = per_group.topk(min(2, E // num_groups), dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices.sort(dim=-1).values
    w = s.gather(1, idx)
    if scaling_at == "before_renorm":
        w = w * scaling
    if top_k > 1 and renormalize:
        w = w / (w.sum(-1, keepdim=True) + renorm_eps)
    return (w * scaling if scaling_at == "after_renorm" else w), idx


def moe_combine(expert_outputs: list[torch.Tensor], weights: torch.Tensor,
                accumulate_in_activation: bool = False) -> torch.Tensor:
    """Σ_k w_k · y_k accumulated in fp32, in slot order: y_k [T, N] (slot k's expert output per token),
    weights [T, k] -> [T, N] in fp32 (the caller casts back). `accumulate_in_activation` rounds the running
    sum to y's dtype after every slot (a bf16 accumulator)."""
    acc = hi(expert_outputs[0]).new_zeros(expert_outputs[0].shape)
    for slot, y in enumerate(expert_outputs):
        acc = acc + hi(weights[:, slot:slot + 1]) * hi(y)
        if accumulate_in_activation:
            acc = hi(acc.to(y.dtype))
    return acc


def attn_res_mix(p: torch.Tensor, blocks: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float, scores_in_activation: bool = False) -> torch.Tensor:
    """Block Attention Residual mix (SPEC §5): p [T, H], blocks n × [T, H] -> [T, H] in p's dtype.

    V = [B_0..B_{n-1}, p] in fp32; K = V·rsqrt(mean(V²) + eps) (no weight); scores = K·(norm.w ⊙ proj.w);
    α = softmax over the n+1 sources; return Σ α·V (raw V), cast back. No 1/√d.
    `scores_in_activation` rounds the scores to p's dtype before the softmax."""
    V = torch.stack([hi(b) for b in blocks] + [hi(p)], dim=0)  # [n+1, T, H]
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    query = hi(norm_w).reshape(-1) * hi(proj_w).reshape(-1)  # [H]
    scores = K @ query  # [n+1, T]
    if scores_in_activation:
        scores = hi(scores.to(p.dtype))
    alpha = torch.softmax(scores, dim=0)  # [n+1, T]
    return (alpha[..., None] * V).sum(0).to(p.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     softmax_in_activation: bool = False) -> torch.Tensor:
    """Causal softmax attention of one sequence: q, k [h, T, dq]; v [h, T, dv] -> [h, T, dv].

    Scores in the activation dtype, softmax in fp32 (as eager attention does), cast back.
    `softmax_in_activation` runs the softmax's exp, sum and division in the activation dtype instead."""
    h, T = q.shape[0], q.shape[1]
    block = attention_query_block(h, T)
    if block >= T:
        return _attention_rows(q, k, v, 0, scale, softmax_in_activation)
    out = q.new_empty(h, T, v.shape[-1])
    for t0 in range(0, T, block):
        out[:, t0:t0 + block] = _attention_rows(q[:, t0:t0 + block], k, v, t0, scale, softmax_in_activation)
    return out


ATTENTION_MAX_SCORES = 1 << 28  # heads x queries x keys held at once by causal_attention: 1 GiB in fp32
ATTENTION_MAX_BLOCK = 1024


def attention_query_block(heads: int, T: int) -> int:
    """Queries per block of causal_attention: all T while heads x T x T scores stay within ATTENTION_MAX_SCORES,
    else blocks of at most ATTENTION_MAX_BLOCK rows, a multiple of 64 (a CPU GEMM's rows then round as in one
    pass; a sliver of rows would take another kernel)."""
    most = min(ATTENTION_MAX_BLOCK, ATTENTION_MAX_SCORES // max(1, heads * T))
    if most >= T:
        return T
    if most < 64:
        return max(1, most)
    even = -(-T // -(-T // most))
    return -(-even // 64) * 64


def _attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t0: int, scale: float,
                    softmax_in_activation: bool) -> torch.Tensor:
    """Queries t0..t0+B-1 (q [h, B, dq]) against all T keys, the future masked -> [h, B, dv]."""
    B, T = q.shape[1], k.shape[1]
    scores = (q @ k.transpose(-1, -2)) * scale  # [h, B, T]
    future = torch.arange(T, device=q.device)[None, :] > torch.arange(t0, t0 + B, device=q.device)[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    if softmax_in_activation:
        e = (scores - scores.amax(dim=-1, keepdim=True)).exp()
        return (e / e.sum(dim=-1, keepdim=True)) @ v
    probs = torch.softmax(hi(scores), dim=-1).to(q.dtype)
    return probs @ v


def sparse_moe(x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor,
               expert: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
               shared: Callable[[torch.Tensor], torch.Tensor],
               latent_down: torch.Tensor | None = None, latent_norm: torch.Tensor | None = None,
               latent_up: torch.Tensor | None = None, eps: float = 0.0,
               combine_in_activation: bool = False) -> torch.Tensor:
    """(Latent) MoE block: x [T, H] -> [T, H].

    The router ran on the hidden x (topk_w, topk_idx [T, k]). LatentMoE: x_lat = down(x) once per
    token, experts run in the latent, fp32 combine, cast back, routed_expert_norm ONCE after the
    combine, up_proj. Shared experts always read the hidden x (identity path)."""
    h = linear(x, latent_down) if latent_down is not None else x  # [T, N]
    slots = h.new_zeros(topk_idx.shape[1], *h.shape)  # [k, T, N]: slot k's expert output per token
    for e in topk_idx.unique().tolist():
        tokens, slot = (topk_idx == e).nonzero(as_tuple=True)  # a token picks an expert at most once
        slots[slot, tokens] = expert(e, h[tokens], tokens)  # expert e, its tokens' rows, their positions
    out = moe_combine(list(slots), topk_w, combine_in_activation).to(x.dtype)
    if latent_norm is not None:
        out = rms_norm(out, latent_norm, eps)
    if latent_up is not None:
        out = linear(out, latent_up)
    return out + shared(x)


def mla(x: torch.Tensor, *, heads: int, qk_nope: int, qk_rope: int, v_dim: int, kv_lora_rank: int,
        kv_a_proj: torch.Tensor, kv_a_norm: torch.Tensor, kv_b_proj: torch.Tensor, o_proj: torch.Tensor,
        q_proj: torch.Tensor | None = None, q_a_proj: torch.Tensor | None = None,
        q_a_norm: torch.Tensor | None = None, q_b_proj: torch.Tensor | None = None,
        g_proj: torch.Tensor | None = None, q_a_eps: float = MLA_LORA_EPS, kv_a_eps: float = MLA_LORA_EPS,
        softmax_in_activation: bool = False) -> torch.Tensor:
    """MLA of one sequence without rotary (mla_use_nope): x [T, H] -> [T, H].

    q = q_b(q_a_layernorm(q_a(x))) (or q_proj); [c | k_rot] = kv_a_proj_with_mqa(x);
    [k_nope | v] = kv_b(kv_a_layernorm(c)); k = [k_nope, k_rot broadcast to heads];
    scale (qk_nope + qk_rope)^-0.5; causal softmax; out *= sigmoid(g_proj(x)) when gated; o_proj.
    Both LoRA norms use eps 1e-6 (q_a_eps, kv_a_eps) whatever the layer eps is."""
    T = x.shape[0]
    absorbed = getattr(kv_b_proj, ACTIVATION_TAG, None) is not None and GGUF_HOOKS["on"]()
    if q_proj is not None:
        q = linear(x, q_proj)
    elif q_a_proj is not None and q_a_norm is not None and q_b_proj is not None:
        q = linear(rms_norm(linear(x, q_a_proj), q_a_norm, q_a_eps), q_b_proj)
    else:
        raise ValueError("mla needs q_proj, or q_a_proj, q_a_norm and q_b_proj")
    if absorbed:
        out = GGUF_HOOKS["mla_absorbed"](x, q, heads=heads, qk_nope=qk_nope, qk_rope=qk_rope, v_dim=v_dim,
                                         kv_lora_rank=kv_lora_rank, kv_a_proj=kv_a_proj, kv_a_norm=kv_a_norm,
                                         kv_b_proj=kv_b_proj, kv_a_eps=kv_a_eps,
                                         softmax_in_activation=softmax_in_activation)
        if g_proj is not None:
            out = out * torch.sigmoid(linear(x, g_proj))
        return linear(out, o_proj)
    q = q.view(T, heads, qk_nope + qk_rope).transpose(0, 1)  # [h, T, dq]
    c, k_rot = linear(x, kv_a_proj).split([kv_lora_rank, qk_rope], dim=-1)
    kv = linear(rms_norm(c, kv_a_norm, kv_a_eps), kv_b_proj).view(T, heads, qk_nope + v_dim).transpose(0, 1)
    k_nope, v = kv.split([qk_nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_rot[None].expand(heads, T, qk_rope)], dim=-1)  # [h, T, dq]
    out = causal_attention(q, k, v, (qk_nope + qk_rope) ** -0.5, softmax_in_activation)
    out = out.transpose(0, 1).reshape(T, heads * v_dim)
    if g_proj is not None:
        out = out * torch.sigmoid(linear(x, g_proj))
    return linear(out, o_proj)


def q8_0_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded as llama.cpp's CPU path quantizes an activation row to Q8_0, in x's
    dtype: per block of 32, in fp32, q = round_half_even(x · id) (int8) with id = 127/max|x| one correctly rounded
    fp32 division, and d = fp16(max|x|/127), rounded to nearest even (the AVX2 `quantize_row_q8_0`); the value is
    q·d. A block of zeros stays zero."""
    _, q, d = q8_0_codes(x)
    return q8_0_value(q, d, x)


def q8_0_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q8_0_round's parts for x [..., K]: the scaled products x · id [..., K/32, 32] (fp32, before rounding), their
    codes q (same shape) and the block scales d [..., K/32, 1]."""
    K = x.shape[-1]
    if K % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 rounds rows in blocks of {Q8_0_BLOCK}; got a row of {K} values")
    blocks = x.float().reshape(*x.shape[:-1], K // Q8_0_BLOCK, Q8_0_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # 127/max|x| as one correctly rounded fp32 division, as ggml's `127.f / maxScalar`: a Python number divided by
    # a tensor is computed as reciprocal times number (two roundings, off by one ulp for a quarter of the values),
    # which moves a product that lands exactly on a tie in ggml off it
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    scaled = blocks * inv
    q = torch.round(scaled)  # torch.round is half-to-even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    d = (amax / 127.0).to(torch.float16).float()  # tensor / number is one correctly rounded division
    return scaled, q, d


def q8_0_value(q: torch.Tensor, d: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The values codes q [..., K/32, 32] with scales d stand for, shaped and typed as `like` [..., K]."""
    return (q * d).reshape(like.shape).to(like.dtype)
