"""KDA (Kimi Delta Attention) recurrence in plain torch: chunked prefill and a one-token step.

Per head, with state S in R^{dk x dv} (fp32), log decay g_t in R^{dk} and beta_t in (0, 1):

    S <- diag(exp(g_t)) S                      (decay acts on the key dim)
    S <- S + beta_t k_t (v_t - S^T k_t)^T      (delta rule on the decayed state)
    o_t = S^T (scale * q_t)

Chunked form (derived here, not taken from fla): inside a chunk of c tokens let G_t = sum_{s<=t} g_s
(relative to the chunk start) and write the per-token correction d_t = beta_t (v_t - (D_t S_{t-1})^T k_t).
Then S_t = diag(e^{G_t}) S_0 + sum_{j<=t} diag(e^{G_t - G_j}) k_j d_j^T, so the corrections solve a unit
lower-triangular system (I + A) d = beta * (v - (e^G * k) S_0) with
A[t, j] = beta_t sum_i k_t[i] k_j[i] e^{G_t[i] - G_j[i]} for j < t. Outputs and the end state follow in
closed form. The pairwise decays e^{G_t - G_j} enter through fp64 products factorized around the
chunk's middle token (each factor within fp64's range), so neither overflow nor the cancellation of
two large fp32 cumsums can spoil them.

Chunks start at each sequence's first token (64-token grid from the sequence start), so a state cut
at a multiple of 64 and handed over in fp32 reproduces the unsegmented result bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3verify.kernels.varlen import Offsets, host_offsets

CHUNK = 64
L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, computed in `dtype` (fp32 unless gold)."""
    x = x.to(dtype)
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _compute_dtype(state: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if state is not None and state.dtype == torch.float64 else torch.float32


MAX_EXP = 600.0  # fp64 exp overflows past ~709; beyond this spread use the pairwise form


def _decayed_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor,
                      incl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kk[t, j] = sum_i k_t k_j e^{G_t - G_j} and qk[t, j] likewise (j <= t; 0 above), in q's dtype.

    Factorized around the chunk's middle token m as (x e^{G - G_m}) (k e^{G_m - G})^T in fp64, which
    keeps each factor's relative precision; when the exponents spread beyond fp64's range it falls
    back to forming every pair's e^{G_t - G_j} (exact but [h, c, c, dk] in memory)."""
    Gm = G[:, G.shape[1] // 2: G.shape[1] // 2 + 1]
    spread = (G - Gm).abs().amax()
    if spread <= MAX_EXP:
        up, down = (G - Gm).exp(), (Gm - G).exp()
        kd = (k.double() * down).transpose(1, 2)  # [h, dk, c]
        kk = (k.double() * up) @ kd
        qk = (q.double() * up) @ kd
    else:
        diff = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~incl[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [h, t, j, dk]
        kk = torch.einsum("hti,htji,hji->htj", k.double(), decay, k.double())
        qk = torch.einsum("hti,htji,hji->htj", q.double(), decay, k.double())
    return kk.masked_fill(~incl, 0.0).to(q.dtype), qk.masked_fill(~incl, 0.0).to(q.dtype)


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk for all heads. q,k,g: [h, c, dk] (q already scaled), v: [h, c, dv], beta: [h, c],
    S: [h, dk, dv]. Returns (o [h, c, dv], S_end [h, dk, dv])."""
    c = q.shape[1]
    # Decay exponents in fp64: G reaches ~-300 inside a chunk (safe gate), and G_t - G_j formed from two
    # fp32 cumsums of that size would lose ~1e-5 of every decay factor that matters.
    G = g.double().cumsum(dim=1)
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    kk, qk = _decayed_products(q, k, G, incl)
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    A = (beta[:, :, None] * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    eG = G.exp().to(q.dtype)
    rhs = beta[:, :, None] * (v - (eG * k) @ S)
    d = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    o = (eG * q) @ S + qk @ d
    tail = (G[:, -1:, :] - G).exp().to(q.dtype) * k  # e^{G_c - G_j} k_j
    S_end = eG[:, -1, :, None] * S + tail.transpose(1, 2) @ d
    return o, S_end


def kda_prefill_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: Offsets, initial_state: torch.Tensor, scale: float,
                      lower_bound: float | None = None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen prefill (a static pack's device offsets are read back: its empty trailing sequences keep
    their initial state).

    q, k: [T, h, dk] raw (L2-normalized here, in fp32); v: [T, h, dv]; g: [T, h, dk] log decay;
    beta: [T, h] post-sigmoid; cu_seqlens: N+1 host ints; initial_state: [N, h, dk, dv] (fp32, or fp64
    for a gold run). `lower_bound` only tells fast paths that g is bounded (safe gate); g is final here.
    Returns o [T, h, dv] in v's dtype and the final state [N, h, dk, dv].
    """
    cu_seqlens = host_offsets(cu_seqlens)
    cdt = _compute_dtype(initial_state)
    qn = (l2_normalize(q, cdt) * scale).transpose(0, 1)  # [h, T, dk]
    kn = l2_normalize(k, cdt).transpose(0, 1)
    vf, gf, bf = v.to(cdt).transpose(0, 1), g.to(cdt).transpose(0, 1), beta.to(cdt).transpose(0, 1)
    o = torch.empty_like(vf)
    finals = []
    for n in range(len(cu_seqlens) - 1):
        S = initial_state[n].to(cdt)
        for s in range(cu_seqlens[n], cu_seqlens[n + 1], chunk):
            e = min(s + chunk, cu_seqlens[n + 1])
            o[:, s:e], S = _chunk_step(qn[:, s:e], kn[:, s:e], vf[:, s:e], gf[:, s:e], bf[:, s:e], S)
        finals.append(S)
    final = torch.stack(finals) if finals else initial_state.new_zeros((0, *initial_state.shape[1:]))
    return o.transpose(0, 1).to(v.dtype), final.to(initial_state.dtype)


def kda_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. q, k, g: [B, h, dk]; v: [B, h, dv]; beta: [B, h]; state [B, h, dk, dv].
    Returns (o [B, h, dv] in v's dtype, new state)."""
    cdt = _compute_dtype(state)
    qn = l2_normalize(q, cdt) * scale
    kn = l2_normalize(k, cdt)
    S = state.to(cdt) * g.to(cdt).exp()[..., None]
    pred = torch.einsum("bhk,bhkv->bhv", kn, S)
    delta = beta.to(cdt)[..., None] * (v.to(cdt) - pred)
    S = S + kn[..., :, None] * delta[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", qn, S)
    return o.to(v.dtype), S.to(state.dtype)


def kda_forget_gate(f_raw: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, heads: int,
             lower_bound: float | None) -> torch.Tensor:
    """The forget gate from f_b_proj's output f_raw [T, h*dk] (activation dtype), dt_bias [h*dk] and the per-head
    decay rate A = exp(A_log) [h, 1] (fp32) -> log-space decay [T, h, dk] fp32: plain -A softplus(f + dt_bias),
    or the safe gate L sigmoid(A (f + dt_bias))."""
    # bf16 + fp32 promotes to fp32 in one kernel: exactly .float() + dt_bias, one launch fewer
    raw = torch.add(f_raw, dt_bias.float())
    raw = raw.view(-1, heads, raw.shape[-1] // heads)
    if lower_bound is None:
        return -A * F.softplus(raw)
    return lower_bound * torch.sigmoid(A * raw)


def kda_beta(b_logits: torch.Tensor) -> torch.Tensor:
    """b_proj(x) [T, h] -> [T, h] fp32: the one and only sigmoid on beta (the recurrences get post-sigmoid values)."""
    return torch.sigmoid(b_logits.float())


def kda_forget_gate_beta(f_raw: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, b_logits: torch.Tensor,
                         heads: int, lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kda_forget_gate, kda_beta) of one layer's raw inputs: A [h] or [h, 1] -> (g [T, h, dk] fp32, beta [T, h]
    fp32)."""
    return kda_forget_gate(f_raw, dt_bias, A.reshape(-1, 1), heads, lower_bound), kda_beta(b_logits)


def kda_decode_slots_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           pool_state: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """kda_decode_torch on the rows' states gathered from the pool, written back in place."""
    o, final = kda_decode_torch(q, k, v, g, beta, pool_state.index_select(0, slots), scale)
    pool_state.index_copy_(0, slots, final.to(pool_state.dtype))
    return o


def kda_decode_slots_gated_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f_raw: torch.Tensor,
                                 dt_bias: torch.Tensor, a_log: torch.Tensor, b_logits: torch.Tensor,
                                 pool_state: torch.Tensor, slots: torch.Tensor, scale: float,
                                 lower_bound: float | None) -> torch.Tensor:
    """kda_decode_slots_torch from the gate's and beta's raw inputs: f_raw [B, h*dk] (f_b_proj's output), dt_bias
    [h*dk], a_log [h] fp32 (A_log's first h entries), b_logits [B, h]; the gate and beta as the prefill gets them
    (kda_forget_gate, kda_beta), op for op."""
    g = kda_forget_gate(f_raw, dt_bias, a_log.exp()[:, None], q.shape[1], lower_bound)
    return kda_decode_slots_torch(q, k, v, g, kda_beta(b_logits), pool_state, slots, scale)
