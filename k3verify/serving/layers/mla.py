"""MLA layer over a packed token stream, with the paged latent cache.

Per token the cache keeps only latent = [c_normed (kv_lora_rank) | k_rot (qk_rope)]. Prefill expands
the latents of each sequence's keys through kv_b_proj and runs causal softmax attention per sequence
(block-diagonal over the pack; a continuation also sees its cached prefix). Decode by default stays in
the latent space: q_nope . W_kb scores against c directly and the output maps back through W_vb.
No rotary (mla_use_nope); scale (qk_nope + qk_rope)^-0.5; K3 gates the output with sigmoid(g_proj(x)).
"""

from __future__ import annotations

import torch
from torch import nn

from k3verify.config import ModelConfig
from k3verify.kernels.attn import causal_attention_packed, causal_attention_static
from k3verify.serving.batch import PackedBatch
from k3verify.serving.context import ForwardContext
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.layers.fused import FusedLinears
from k3verify.serving.layers.linear import LinearFactory, linear
from k3verify.serving.layers.norm import RMSNorm

LORA_NORM_EPS = 1e-6  # the two MLA LoRA norms keep 1e-6 whatever rms_norm_eps says
KeyRange = tuple[int, int, int]  # (first key, end key, query offset) of one sequence in the key stream


def key_ranges(batch: PackedBatch, key_cu: list[int]) -> list[KeyRange]:
    """Sequence i attends keys [key_cu[i], key_cu[i+1]); its query t sees keys up to offset + t,
    where offset = its cached prefix length. This is the block-diagonal causal mask."""
    return [(key_cu[i], key_cu[i + 1], batch.start_list[i]) for i in range(batch.num_seqs)]


def context_rows(b: PackedBatch, cache: PagedLatentCache, total: int) -> torch.Tensor:
    """Latent-cache rows of every key the pack's sequences see (sequence i: its positions 0 .. start_i + n_i - 1),
    concatenated ([total]). Built on the device from the pack's tensors (`total` is known on the host): no copy
    from host memory, which on CUDA would wait for every queued kernel."""
    assert b.page_table is not None
    lens = b.start_pos + (b.cu_seqlens[1:] - b.cu_seqlens[:-1])  # [B] keys per sequence
    seq = torch.repeat_interleave(torch.arange(b.num_seqs, device=lens.device), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens  # each sequence's first key in the concatenation
    pos = torch.arange(total, device=lens.device) - first[seq]
    return cache.rows(b.page_table, seq, pos)


def decode_rows(b: PackedBatch, cache: PagedLatentCache) -> tuple[torch.Tensor, torch.Tensor]:
    """For queries against the cache (a decode step: one token per sequence; a score pack: several): which
    of the padded context positions each token sees ([T, L] bool, L the longest context) and the latent-cache
    rows holding them ([T, L]; masked positions read their sequence's row 0). Host ints only: no sync."""
    assert b.page_table is not None
    device = b.positions.device
    lens = b.positions + 1  # [T] tokens each query sees, itself included
    L = int(max(b.start_list)) + max(b.seq_lens)
    pos = torch.arange(L, device=device)[None, :].expand(b.num_tokens, -1)
    valid = pos < lens[:, None]
    seq = b.seg_ids[:, None].expand(-1, L)
    return valid, cache.rows(b.page_table, seq, torch.where(valid, pos, 0))


def attention_probs(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim (keys) in fp32, the reference's precision, cast to `dtype` once."""
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


class MultiHeadLatentAttention(nn.Module):
    """out_linear builds o_proj (a tensor-parallel rank's reduces its partial sum over heads)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, *, out_linear: LinearFactory = linear) -> None:
        super().__init__()
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx, self.heads = layer_idx, nh
        self.nope, self.rope, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                       cfg.kv_lora_rank)
        self.scale = cfg.qk_head_dim**-0.5
        if cfg.q_lora_rank is None:
            self.q_proj = linear(H, nh * cfg.qk_head_dim, dtype, device)
        else:
            self.q_a_proj = linear(H, cfg.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, dtype, device)
        self.kv_a_proj_with_mqa = linear(H, self.rank + self.rope, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = linear(self.rank, nh * (self.nope + self.v_dim), dtype, device)
        self.o_proj = out_linear(nh * self.v_dim, H, dtype, device)
        if cfg.mla_use_output_gate:
            self.g_proj = linear(H, nh * self.v_dim, dtype, device)
        # Every projection of x as one GEMM: the query input, the latent, and K3's output gate.
        q_in = self.q_proj if cfg.q_lora_rank is None else self.q_a_proj
        gate = [self.g_proj] if cfg.mla_use_output_gate else []
        self.in_proj = FusedLinears([q_in, self.kv_a_proj_with_mqa, *gate])

    def latent(self, kv_a: torch.Tensor) -> torch.Tensor:
        """kv_a_proj_with_mqa(x) [T, rank + rope] -> [T, rank + rope]: what the cache stores."""
        c, k_rot = kv_a.split([self.rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_rot], dim=-1)

    def queries(self, q_in: torch.Tensor) -> torch.Tensor:
        """q_proj(x), or q_a_proj(x) with a query LoRA -> [T, heads, nope + rope]."""
        q = q_in if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(q_in))
        return q.view(q_in.shape[0], self.heads, self.nope + self.rope)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, cache = ctx.batch, ctx.kv_cache
        T = x.shape[0]
        q_in, kv_a, *gate = self.in_proj(x)
        q, lat = self.queries(q_in), self.latent(kv_a)
        if cache is not None:
            if ctx.kv_rows is None:
                raise ValueError("an MLA pass with a latent cache needs ctx.kv_rows")
            cache.write(self.layer_idx, ctx.kv_rows, lat)
        elif b.is_decode or b.has_prefix:
            raise ValueError("decode / prefix continuation needs the latent cache")
        if (b.is_decode or ctx.score is not None) and ctx.mla_absorb:
            out = self._decode_absorbed(q, ctx)
        else:
            out = self._attend(q, lat, ctx)
        out = out.reshape(T, self.heads * self.v_dim)
        if gate:
            out = out * torch.sigmoid(gate[0])
        return self.o_proj(out)

    def _context_latents(self, lat: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, list[int]]:
        """Latents of every key each sequence sees, concatenated ([Tk, width]), and their offsets."""
        b = ctx.batch
        if not (b.is_decode or b.has_prefix):
            return lat, b.cu_list  # fresh sequences: the keys are exactly the pack's own tokens
        cache = ctx.kv_cache
        assert cache is not None and b.page_table is not None
        lens = [s + n for s, n in zip(b.start_list, b.seq_lens, strict=True)]
        key_cu = [0]
        for n in lens:
            key_cu.append(key_cu[-1] + n)
        rows = ctx.memo("mla.context_rows", lambda: context_rows(b, cache, key_cu[-1]))  # shared by the MLA layers
        return cache.layer(self.layer_idx).index_select(0, rows).to(lat.dtype), key_cu

    def _keys_values(self, keys_lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [Tk, rank + rope] -> keys [Tk, nh, nope + rope] and values [Tk, nh, v_dim] (kv_b_proj expanded)."""
        kv = self.kv_b_proj(keys_lat[:, : self.rank]).view(-1, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = keys_lat[:, None, self.rank:].expand(-1, self.heads, -1)
        return torch.cat([k_nope, k_rot], dim=-1), v

    def _attend(self, q: torch.Tensor, lat: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b = ctx.batch
        if b.static is not None:  # fresh sequences, offsets on the device only (a CUDA-graph prefill)
            k, v = self._keys_values(lat)
            return causal_attention_static(q, k, v, b.static, b.seg_ids, b.local_pos, self.scale)
        keys_lat, key_cu = self._context_latents(lat, ctx)
        k, v = self._keys_values(keys_lat)
        return causal_attention_packed(q, k, v, b.cu_list, key_ranges(b, key_cu), self.scale)

    def _decode_absorbed(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Every query token against its sequence's cached context up to itself, in the latent space (one token
        per sequence in decode, k+1 in a score pack). q [T, nh, nope+rope] -> [T, nh, v_dim]. Contexts are
        padded to the longest and masked."""
        b, cache = ctx.batch, ctx.kv_cache
        assert cache is not None and b.page_table is not None
        ctx.bump("mla_absorbed_decode")
        valid, rows = ctx.memo("mla.decode_rows", lambda: decode_rows(b, cache))  # shared by the MLA layers
        lat = cache.layer(self.layer_idx)[rows].to(q.dtype)  # [B, L, width]
        c, k_rot = lat[..., : self.rank], lat[..., self.rank:]
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        w_k, w_v = w[:, : self.nope], w[:, self.nope:]
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_k)
        scores = (torch.einsum("bhr,blr->bhl", q_lat, c) + torch.einsum("bhd,bld->bhl", q_rope, k_rot)) * self.scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = attention_probs(scores, q.dtype)
        o_lat = torch.einsum("bhl,blr->bhr", probs, c)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_v)
