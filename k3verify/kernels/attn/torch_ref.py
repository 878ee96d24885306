"""Causal softmax attention of one sequence, eager: the reference order of the serving MLA prefill.

Queries run in blocks so that no call holds the whole [h, Lq, Lk] score matrix (at 128K tokens and 96 heads it
would be 6 TB in fp32): a block of queries sees every key, masked as before, so each query row goes through
the very same matmul, masked fill and softmax as in one pass, and the result is bit-identical on CPU."""

from __future__ import annotations

import torch

MAX_QUERY_BLOCK = 1024  # queries per block at most (short prompts run in one block)
MAX_BLOCK_SCORES = 1 << 28  # heads x queries x keys of one block: 1 GiB of fp32 scores
ROW_TILE = 64  # query blocks are multiples of this many rows


def query_block(heads: int, num_queries: int, num_keys: int) -> int:
    """Queries per block: at most MAX_QUERY_BLOCK, fewer where heads x block x keys would pass MAX_BLOCK_SCORES;
    the blocks are of (nearly) equal size, rounded up to a multiple of ROW_TILE, so every row sits at the same
    place within a CPU GEMM's row tiles as in one pass (a sliver of rows takes another kernel, rounding otherwise)."""
    most = max(1, min(MAX_QUERY_BLOCK, MAX_BLOCK_SCORES // max(1, heads * num_keys)))
    if most >= num_queries:
        return num_queries
    even = -(-num_queries // -(-num_queries // most))
    return -(-even // ROW_TILE) * ROW_TILE if most >= ROW_TILE else most


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """q [h, Lq, d], k [h, Lk, d], v [h, Lk, dv]; query t sees keys 0..offset+t -> [h, Lq, dv]. Eager order per
    query block: scores in the activation dtype, softmax in fp32, cast back, then P @ V."""
    h, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
    block = query_block(h, Lq, Lk)
    if block >= Lq:
        return _block(q, k, v, offset, scale)
    out = q.new_empty(h, Lq, v.shape[2])
    for q0 in range(0, Lq, block):
        q1 = min(q0 + block, Lq)
        out[:, q0:q1] = _block(q[:, q0:q1], k, v, offset + q0, scale)
    return out


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """Queries q [h, Bq, d] at positions offset..offset+Bq-1 against every key -> [h, Bq, dv]."""
    Lq, Lk = q.shape[1], k.shape[1]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [h, Bq, Lk]
    allowed = torch.arange(Lk, device=q.device)[None, :] <= (torch.arange(Lq, device=q.device)[:, None] + offset)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
