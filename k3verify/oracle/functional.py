"""The reference maths of SPEC-K3, one plain function per formula.

Every "in fp32" of the spec is written as `hi(x)`: fp32 for bf16/fp32 inputs, fp64 for fp64
inputs, so an fp64 reference never rounds through fp32. Shapes: T tokens, H hidden, D = heads·dim.
Nothing here imports serving/ or kernels/ (tests/oracle/test_oracle_isolation.py enforces it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x² + eps), not F.normalize's max(‖x‖, eps)
RENORM_EPS = 1e-20
MLA_LORA_EPS = 1e-6  # the two MLA LoRA norms, whatever rms_norm_eps says (SPEC §1)


def hi(x: torch.Tensor) -> torch.Tensor:
    """x in the spec's "fp32" precision: fp32, or fp64 when x is already fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in]ᵀ -> [..., out] in x's dtype (the weight is cast at the call site)."""
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


def kda_gate_plain(g: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear forget gate in log space: g [T, h, dk] raw f_b(f_a(x)); a_log [h]; dt_bias [h·dk].

    Returns −exp(A_log[h]) · softplus(g + dt_bias) in fp32, shape [T, h, dk]."""
    heads, dk = g.shape[-2:]
    x = hi(g) + hi(dt_bias).view(heads, dk)
    return -torch.exp(hi(a_log).view(heads, 1)) * F.softplus(x)


def kda_gate_safe(g: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """K3 "safe gate": L · sigmoid(exp(A_log[h]) · (g + dt_bias)) in fp32, in [L, 0); shapes as kda_gate_plain."""
    heads, dk = g.shape[-2:]
    x = hi(g) + hi(dt_bias).view(heads, dk)
    return lower_bound * torch.sigmoid(torch.exp(hi(a_log).view(heads, 1)) * x)


def causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of ONE sequence + SiLU: x [T, D], weight [D, 1, W] or [D, W] -> [T, D].

    Left zero-pad of W−1 (the sequence start); the weight is cast to x's dtype here because K3
    ships conv weights in fp32 while activations are bf16."""
    w = weight.reshape(weight.shape[0], -1).to(x.dtype)  # [D, W]
    W = w.shape[1]
    padded = torch.cat([x.new_zeros(W - 1, x.shape[1]), x], dim=0)  # [T+W-1, D]
    out = torch.zeros_like(x)
    for j in range(W):  # tap j sees token t−(W−1−j)
        out = out + padded[j:j + x.shape[0]] * w[:, j]
    return F.silu(out)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d] in fp32: x / sqrt(sum(x²) + 1e-6)."""
    h = hi(x)
    return h / torch.sqrt(h.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


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
           renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with correction bias: x [T, H] -> (weights [T, k] fp32, idx [T, k] int64).

    Logits x·Wᵀ in fp32; s = sigmoid; choose top-k of s + bias (restricted to the best `topk_group`
    groups, scored by the sum of their two best biased scores as in noaux_tc, when num_groups >
    topk_group); weights are the UNcorrected s; renormalize /(sum + 1e-20) when top_k > 1; × scaling.
    Indices are sorted ascending per token so that two implementations can be compared."""
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
    if top_k > 1 and renormalize:
        w = w / (w.sum(-1, keepdim=True) + RENORM_EPS)
    return w * scaling, idx


def moe_combine(expert_outputs: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k · y_k accumulated in fp32, in slot order: y_k [T, N] (slot k's expert output per token),
    weights [T, k] -> [T, N] in fp32 (the caller casts back)."""
    acc = hi(expert_outputs[0]).new_zeros(expert_outputs[0].shape)
    for slot, y in enumerate(expert_outputs):
        acc = acc + hi(weights[:, slot:slot + 1]) * hi(y)
    return acc


def attn_res_mix(p: torch.Tensor, blocks: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Block Attention Residual mix (SPEC §5): p [T, H], blocks n × [T, H] -> [T, H] in p's dtype.

    V = [B_0..B_{n-1}, p] in fp32; K = V·rsqrt(mean(V²) + eps) (no weight); scores = K·(norm.w ⊙ proj.w);
    α = softmax over the n+1 sources; return Σ α·V (raw V), cast back. No 1/√d."""
    V = torch.stack([hi(b) for b in blocks] + [hi(p)], dim=0)  # [n+1, T, H]
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    query = hi(norm_w).reshape(-1) * hi(proj_w).reshape(-1)  # [H]
    alpha = torch.softmax(K @ query, dim=0)  # [n+1, T]
    return (alpha[..., None] * V).sum(0).to(p.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of one sequence: q, k [h, T, dq]; v [h, T, dv] -> [h, T, dv].

    Scores in the activation dtype, softmax in fp32 (as eager attention does), cast back."""
    T = q.shape[1]
    scores = (q @ k.transpose(-1, -2)) * scale  # [h, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(hi(scores.masked_fill(future, float("-inf"))), dim=-1).to(q.dtype)
    return probs @ v


def sparse_moe(x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor,
               expert: Callable[[int, torch.Tensor], torch.Tensor], shared: Callable[[torch.Tensor], torch.Tensor],
               latent_down: torch.Tensor | None = None, latent_norm: torch.Tensor | None = None,
               latent_up: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """(Latent) MoE block: x [T, H] -> [T, H].

    The router ran on the hidden x (topk_w, topk_idx [T, k]). LatentMoE: x_lat = down(x) once per
    token, experts run in the latent, fp32 combine, cast back, routed_expert_norm ONCE after the
    combine, up_proj. Shared experts always read the hidden x (identity path)."""
    h = linear(x, latent_down) if latent_down is not None else x  # [T, N]
    slots = h.new_zeros(topk_idx.shape[1], *h.shape)  # [k, T, N]: slot k's expert output per token
    for e in topk_idx.unique().tolist():
        tokens, slot = (topk_idx == e).nonzero(as_tuple=True)  # a token picks an expert at most once
        slots[slot, tokens] = expert(e, h[tokens])
    out = moe_combine(list(slots), topk_w).to(x.dtype)
    if latent_norm is not None:
        out = rms_norm(out, latent_norm, eps)
    if latent_up is not None:
        out = linear(out, latent_up)
    return out + shared(x)


def mla(x: torch.Tensor, *, heads: int, qk_nope: int, qk_rope: int, v_dim: int, kv_lora_rank: int,
        kv_a_proj: torch.Tensor, kv_a_norm: torch.Tensor, kv_b_proj: torch.Tensor, o_proj: torch.Tensor,
        q_proj: torch.Tensor | None = None, q_a_proj: torch.Tensor | None = None,
        q_a_norm: torch.Tensor | None = None, q_b_proj: torch.Tensor | None = None,
        g_proj: torch.Tensor | None = None, lora_eps: float = MLA_LORA_EPS) -> torch.Tensor:
    """MLA of one sequence without rotary (mla_use_nope): x [T, H] -> [T, H].

    q = q_b(q_a_layernorm(q_a(x))) (or q_proj); [c | k_rot] = kv_a_proj_with_mqa(x);
    [k_nope | v] = kv_b(kv_a_layernorm(c)); k = [k_nope, k_rot broadcast to heads];
    scale (qk_nope + qk_rope)^-0.5; causal softmax; out *= sigmoid(g_proj(x)) when gated; o_proj.
    Both LoRA norms use eps 1e-6 whatever the layer eps is."""
    T = x.shape[0]
    if q_proj is not None:
        q = linear(x, q_proj)
    elif q_a_proj is not None and q_a_norm is not None and q_b_proj is not None:
        q = linear(rms_norm(linear(x, q_a_proj), q_a_norm, lora_eps), q_b_proj)
    else:
        raise ValueError("mla needs q_proj, or q_a_proj, q_a_norm and q_b_proj")
    q = q.view(T, heads, qk_nope + qk_rope).transpose(0, 1)  # [h, T, dq]
    c, k_rot = linear(x, kv_a_proj).split([kv_lora_rank, qk_rope], dim=-1)
    kv = linear(rms_norm(c, kv_a_norm, lora_eps), kv_b_proj).view(T, heads, qk_nope + v_dim).transpose(0, 1)
    k_nope, v = kv.split([qk_nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_rot[None].expand(heads, T, qk_rope)], dim=-1)  # [h, T, dq]
    out = causal_attention(q, k, v, (qk_nope + qk_rope) ** -0.5).transpose(0, 1).reshape(T, heads * v_dim)
    if g_proj is not None:
        out = out * torch.sigmoid(linear(x, g_proj))
    return linear(out, o_proj)
