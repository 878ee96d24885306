"""KDA layer (Kimi Delta Attention) over a packed token stream.

x [T, H] -> q/k/v projections [T, D] (one GEMM with f_a, the gate input and b) -> per-sequence causal
conv + SiLU (windows from the state pool for continuations / decode) -> q, k L2-normalized in fp32 inside
the recurrence, q scaled by dk^-0.5 -> recurrence with fp32 state (kernels.kda) -> gated RMSNorm with the
output gate -> o_proj.
D = heads * dk; the KDA value head dim equals dk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from k3verify.config import ModelConfig
from k3verify.kernels.conv import causal_conv_qkv, conv_decode_qkv
from k3verify.kernels.kda import CHUNK, kda_decode_slots_gated, kda_forget_gate_beta, kda_prefill
from k3verify.kernels.kda.score import kda_score
from k3verify.kernels.kda.torch_ref import kda_forget_gate
from k3verify.serving.context import ForwardContext
from k3verify.serving.layers.fused import FusedLinears
from k3verify.serving.layers.linear import LinearFactory, linear
from k3verify.serving.layers.norm import GatedRMSNorm

Pieces = list[list[tuple[int, int]]]  # per sequence: (start, end) offsets of its prefill segments
ConvWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v: [D, W] each


class ShortConv(nn.Module):
    """Holds a depthwise conv weight [D, 1, W]; K3 ships it fp32, KimiDeltaAttention.conv_weights casts it."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width, dtype=torch.float32), requires_grad=False)


def segment_pieces(seq_lens: list[int], segment_len: int | None) -> Pieces:
    """Cut every sequence into segments of `segment_len` tokens (the last one may be shorter)."""
    if segment_len is None:
        return [[(0, n)] for n in seq_lens]
    if segment_len <= 0 or segment_len % CHUNK:
        raise ValueError(f"segment_len must be a positive multiple of the {CHUNK}-token KDA chunk; got {segment_len}")
    return [[(s, min(s + segment_len, n)) for s in range(0, n, segment_len)] for n in seq_lens]


def check_pieces(seq_lens: list[int], pieces: Pieces) -> None:
    """Refuse any cut that is not on the chunk grid of its sequence: a mid-chunk cut regroups the
    chunked recurrence and changes the result (state hand-over is exact only at chunk boundaries)."""
    for i, (n, segs) in enumerate(zip(seq_lens, pieces, strict=True)):
        if segs[0][0] != 0 or segs[-1][1] != n or any(a[1] != b[0] for a, b in zip(segs[:-1], segs[1:], strict=True)):
            raise ValueError(f"sequence {i}: segments {segs} do not tile its {n} tokens")
        bad = [s for s, _ in segs[1:] if s % CHUNK]
        if bad:
            raise ValueError(f"sequence {i}: KDA segment cut(s) at {bad} are not multiples of {CHUNK} "
                             f"from the sequence start; refusing a mid-chunk cut")


def run_pieces_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         cu: list[int], pieces: Pieces, state: torch.Tensor, scale: float,
                         lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round r runs the r-th segment of every sequence that has one, as one packed call, with the
    fp32 state handed over from round r-1. No cut validation: callers go through check_pieces."""
    if all(len(p) == 1 for p in pieces):
        return kda_prefill(q, k, v, g, beta, cu, state, scale, lower_bound=lower_bound)
    out = torch.empty_like(v)
    state = state.clone()
    for r in range(max(len(p) for p in pieces)):
        members = [i for i, p in enumerate(pieces) if r < len(p)]
        idx = torch.cat([torch.arange(cu[i] + pieces[i][r][0], cu[i] + pieces[i][r][1]) for i in members])
        idx = idx.to(q.device)
        sub_cu = [0]
        for i in members:
            sub_cu.append(sub_cu[-1] + pieces[i][r][1] - pieces[i][r][0])
        rows = torch.tensor(members, device=q.device)
        o, final = kda_prefill(q[idx], k[idx], v[idx], g[idx], beta[idx], sub_cu, state[rows], scale,
                               lower_bound=lower_bound)
        out[idx] = o
        state[rows] = final
    return out, state


class KimiDeltaAttention(nn.Module):
    """out_linear builds o_proj (a tensor-parallel rank's reduces its partial sum over heads); a_log_width: the
    stored A_log length when it is not cfg.a_log_width (a rank holds exactly its heads' slice of K3's padded one)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, *, out_linear: LinearFactory = linear,
                 a_log_width: int | None = None) -> None:
        super().__init__()
        H, D, h, dk, W = cfg.hidden_size, cfg.kda_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        self.layer_idx, self.heads, self.head_dim = layer_idx, h, dk
        self.lower_bound = cfg.gate_lower_bound
        self.q_proj, self.k_proj, self.v_proj = (linear(H, D, dtype, device) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(D, W) for _ in range(3))
        self._derived: dict[Any, tuple[tuple[tuple[int, int], ...], Any]] = {}
        a_shape = (cfg.a_log_width if a_log_width is None else a_log_width,) if cfg.is_k3 else (1, 1, h, 1)
        self.A_log = nn.Parameter(torch.zeros(a_shape, dtype=torch.float32), requires_grad=False)
        self.f_a_proj = linear(H, dk, dtype, device)
        self.f_b_proj = linear(dk, D, dtype, device)
        self.dt_bias = nn.Parameter(torch.zeros(D, dtype=torch.float32), requires_grad=False)
        self.b_proj = linear(H, h, dtype, device)
        if cfg.use_full_rank_gate:
            self.g_proj = linear(H, D, dtype, device)
        else:
            self.g_a_proj = linear(H, dk, dtype, device)
            self.g_b_proj = linear(dk, D, dtype, device)
        self.o_norm = GatedRMSNorm(dk, cfg.rms_norm_eps)
        self.o_proj = out_linear(D, H, dtype, device)
        gate_in = self.g_proj if cfg.use_full_rank_gate else self.g_a_proj
        self.in_proj = FusedLinears([self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate_in, self.b_proj])

    def forget_gate_input(self, f_a: torch.Tensor) -> torch.Tensor:
        """f_a_proj(x) [T, dk] -> f_b_proj's output [T, D]: the forget gate's raw input (no activation between)."""
        return self.f_b_proj(f_a)

    def forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """f_a_proj(x) [T, dk] -> log-space decay [T, h, dk] in fp32: plain -exp(A) softplus(.) or safe
        L sigmoid(exp(A) .) (kernels/kda/torch_ref.kda_forget_gate, which the decode step's torch path shares)."""
        return kda_forget_gate(self.forget_gate_input(f_a), self.dt_bias, self.decay_rate(), self.heads,
                               self.lower_bound)

    def _from_weights(self, key: Any, params: tuple[torch.Tensor, ...], make: Callable[[], Any]) -> Any:
        """A value derived from parameters, made once and remade when any of them is reloaded (copy_
        bumps _version) or moved (new data_ptr)."""
        stamp = tuple((p.data_ptr(), p._version) for p in params)
        hit = self._derived.get(key)
        if hit is None or hit[0] != stamp:
            hit = (stamp, make())
            self._derived[key] = hit
        return hit[1]

    def a_log_row(self) -> torch.Tensor:
        """A_log's first `heads` entries [h] fp32, contiguous (a constant of the weights)."""
        def make() -> torch.Tensor:
            row = self.A_log.float().reshape(-1)[: self.heads]  # K3 pads A_log past the heads
            return row.contiguous()

        return self._from_weights("a_log", (self.A_log,), make)

    def decay_rate(self) -> torch.Tensor:
        """exp(A_log) per head [h, 1] fp32 (a constant of the weights)."""
        return self._from_weights("decay", (self.A_log,), lambda: self.a_log_row().exp()[:, None])

    def output_gate(self, gate_in: torch.Tensor) -> torch.Tensor:
        """g_proj(x) (full rank: already the gate) or g_a_proj(x) [T, dk] -> the gate [T, D]."""
        if hasattr(self, "g_proj"):
            return gate_in
        return self.g_b_proj(gate_in)

    def forget_gate_and_beta(self, f_a: torch.Tensor, b_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forget_gate(f_a) and beta [T, h] fp32 of a prefill or score pass, beta's one and only sigmoid included:
        op kda.gate_beta (torch_ref.kda_forget_gate / kda_beta; on CUDA in bf16 one Triton launch for their six)."""
        return kda_forget_gate_beta(self.forget_gate_input(f_a), self.dt_bias, self.decay_rate(), b_logits, self.heads,
                             self.lower_bound)

    def conv_weights(self, dtype: torch.dtype) -> ConvWeights:
        """q/k/v conv weights [D, W] in the activation dtype (K3 ships them fp32), cast once per dtype."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return self._from_weights(("conv", dtype), tuple(c.weight for c in convs),
                                  lambda: tuple(c.weight.to(dtype).reshape(c.weight.shape[0], -1) for c in convs))

    def short_convs(self, xs: Sequence[torch.Tensor], ctx: ForwardContext, keep: torch.Tensor,
                    continuing: bool) -> list[torch.Tensor]:
        """q, k, v projections [T, D] (column slices of the fused GEMM) through their causal convs [T, D];
        windows come from / go to the pool. Decode runs the three convs as one step on the pool's windows;
        prefill runs the packed gather conv."""
        b, pool = ctx.batch, ctx.state_pool
        weights = self.conv_weights(xs[0].dtype)
        if b.is_decode and pool is not None:
            assert b.slots is not None
            return list(conv_decode_qkv((xs[0], xs[1], xs[2]), weights, pool.conv_views(self.layer_idx), b.slots,
                                        keep.view(-1)))
        if (continuing or pool is not None) and (pool is None or b.slots is None):
            raise RuntimeError(f"KDA layer {self.layer_idx}: a cached prefill needs the state pool and slots")
        inits = None
        if continuing and pool is not None and b.slots is not None:
            windows = pool.windows(self.layer_idx, b.slots, xs[0].dtype)
            inits = (windows[0] * keep, windows[1] * keep, windows[2] * keep)
        outs, finals = causal_conv_qkv((xs[0], xs[1], xs[2]), weights, b.seg_ids, b.local_pos, b.cu_seqlens, inits)
        if pool is not None and b.slots is not None:
            pool.store_windows(self.layer_idx, b.slots, *finals)
        return list(outs)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.score is not None:
            return self.score_forward(x, ctx)
        b, pool = ctx.batch, ctx.state_pool
        T, h, dk = x.shape[0], self.heads, self.head_dim
        if pool is not None and b.slots is None:
            raise ValueError("a KDA pass with a state pool needs batch.slots")
        continuing = pool is not None and (b.is_decode or b.has_prefix)
        keep = ctx.fresh_mask(x.dtype)  # [B, 1, 1]: 0 for fresh sequences (zero windows/state), else 1
        q_in, k_in, v_in, f_a, gate_in, b_logits = self.in_proj(x)
        q, k, v = (t.view(T, h, dk) for t in self.short_convs((q_in, k_in, v_in), ctx, keep, continuing))
        scale = dk**-0.5  # q's scale, decode and prefill alike
        if b.is_decode:
            if pool is None or b.slots is None:
                raise ValueError("KDA decode needs the state pool and batch.slots")
            # States are read and updated in place, by slot. No `keep` mask: a slot is zeroed when it is
            # allocated (gated by serving.state.slot_reuse), so a sequence's first step reads zeros. The gate
            # and beta go in raw: the step makes them (kda_forget_gate, kda_beta; on CUDA inside the recurrence kernel).
            o = kda_decode_slots_gated(q, k, v, self.forget_gate_input(f_a), self.dt_bias, self.a_log_row(), b_logits,
                                       pool.state_view(self.layer_idx), b.slots, scale, self.lower_bound)
        else:
            g, beta = self.forget_gate_and_beta(f_a, b_logits)
            if continuing:
                assert pool is not None and b.slots is not None
                state0 = pool.read_state(self.layer_idx, b.slots) * keep.float()[..., None]
            else:
                state0 = torch.zeros(b.num_seqs, h, dk, dk, dtype=torch.float32, device=x.device)
            if b.static is not None:  # whole fresh sequences, offsets on the device only (a CUDA-graph prefill)
                if ctx.segment_len is not None:
                    raise ValueError("a static pack runs whole sequences; segment_len must be None")
                o, state = kda_prefill(q, k, v, g, beta, b.static, state0, scale, lower_bound=self.lower_bound)
            else:
                pieces = segment_pieces(b.seq_lens, ctx.segment_len)
                check_pieces(b.seq_lens, pieces)
                if ctx.segment_len is not None:
                    ctx.bump("kda_segmented")
                o, state = run_pieces_unchecked(q, k, v, g, beta, b.cu_list, pieces, state0, scale,
                                                self.lower_bound)
            if pool is not None:
                assert b.slots is not None
                pool.store_state(self.layer_idx, b.slots, state)
        o = self.o_norm(o, self.output_gate(gate_in).view(T, h, dk))
        return self.o_proj(o.reshape(T, h * dk))

    def score_forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A speculative score pack (B sequences x n tokens, all continuing): each position runs a decode
        step's math; the windows and state after every position go to the score arena, the pool is only
        read (a commit later copies the accepted position's record into it)."""
        b, pool, spec = ctx.batch, ctx.state_pool, ctx.score
        assert spec is not None
        if pool is None or b.slots is None:
            raise ValueError("a KDA score pass needs the state pool and batch.slots")
        B, n, T, h, dk = b.num_seqs, spec.num_positions, x.shape[0], self.heads, self.head_dim
        if T != B * n:
            raise ValueError(f"a score pack holds {n} tokens per sequence: {B} sequences need {B * n} tokens, got {T}")
        q_in, k_in, v_in, f_a, gate_in, b_logits = self.in_proj(x)
        # [B, n, D] views of the fused GEMM's column slices: the score kernels take their row stride, no copies
        xs = (q_in.reshape(B, n, -1), k_in.reshape(B, n, -1), v_in.reshape(B, n, -1))
        state_records, conv_records = spec.arena.records(self.layer_idx, B)
        g, beta = self.forget_gate_and_beta(f_a, b_logits)
        _, y = kda_score(xs, self.conv_weights(x.dtype), pool.conv_views(self.layer_idx),
                          pool.state_view(self.layer_idx), b.slots, ctx.fresh_mask(x.dtype).view(-1),
                          g.view(B, n, h, dk), beta.view(B, n, h),
                          self.output_gate(gate_in).reshape(B, n, h, dk).contiguous(), self.o_norm.weight,
                          self.o_norm.eps, dk**-0.5, conv_records, state_records, fused=spec.fused)
        ctx.bump("kda_verify")
        return self.o_proj(y.reshape(T, h * dk))
