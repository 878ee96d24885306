"""Causal attention of a packed batch of sequences in one call (MLA prefill, no Python loop on CUDA).

Sequence i's queries q[q_cu[i]:q_cu[i+1]] attend its keys k[k0:k1] (its cached prefix, then its own tokens),
query t seeing keys 0..offset+t, for (k0, k1, offset) = ranges[i] (serving/layers/mla.key_ranges).
The torch reference runs one sequence at a time (torch_ref.causal_attention, the eager order). The CUDA path
pads the pack to [B, L] once and makes one fused SDPA call: is_causal when every sequence is fresh (its keys are
its own queries; a shorter one's padding comes after all its real queries, so they never see it: no mask tensor
at all), else a [B, Lq, Lk] boolean mask up to MAX_MASK_ELEMENTS, and past it one call per sequence with the
causal mask aligned to the lower right (no mask tensor: a long prompt chunked over its cached prefix). The
backend, and the padded lengths, come from sdpa.py (cuDNN only for large calls, at bucketed lengths: it builds a
graph per new shape). The per-sequence offsets and the kept rows go
to the device from pinned memory: a non_blocking copy from pageable memory may wait for the stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3verify.kernels.attn import sdpa, torch_ref
from k3verify.kernels.pinned import to_device
from k3verify.kernels.varlen import DeviceSeqlens

KeyRange = tuple[int, int, int]
_DTYPES = (torch.bfloat16, torch.float16)
MAX_MASK_ELEMENTS = 1 << 26  # a pack over cached prefixes builds a [B, Lq, Lk] boolean mask only up to 64 MB


def causal_attention_packed_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cu: list[int],
                                  ranges: list[KeyRange], scale: float) -> torch.Tensor:
    """q [Tq, h, d], k [Tk, h, d], v [Tk, h, dv] -> [Tq, h, dv], one sequence at a time."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for i, (k0, k1, offset) in enumerate(ranges):
        q0, q1 = q_cu[i], q_cu[i + 1]
        out[q0:q1] = torch_ref.causal_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                                v[k0:k1].transpose(0, 1), offset, scale).transpose(0, 1)
    return out


def accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cu: list[int], ranges: list[KeyRange],
            scale: float) -> str | None:
    if not q.is_cuda:
        return f"tensors are on {q.device}, not CUDA"
    if q.dtype not in _DTYPES:
        return f"activation dtype {q.dtype} is not one of {_DTYPES} (the exact fp32 path is the torch reference)"
    bad = [i for i, (k0, k1, off) in enumerate(ranges) if k1 - k0 < off + q_cu[i + 1] - q_cu[i]]
    if bad:
        return f"sequence(s) {bad[:4]}: fewer keys than their offset + queries (a query would see a missing key)"
    return None


def _padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: torch.Tensor, k_rows: torch.Tensor,
                 allowed: torch.Tensor | None, scale: float, cudnn: bool) -> torch.Tensor:
    """The pack gathered to [B, h, Lq | Lk, d] by row indices [B, Lq] / [B, Lk], one fused SDPA call (causal, or
    with the boolean mask `allowed` [B, Lq, Lk]) -> [B * Lq, h, dv] in padded order."""
    qp, kp, vp = q[q_rows].transpose(1, 2), k[k_rows].transpose(1, 2), v[k_rows].transpose(1, 2)  # [B, h, L, d]
    with sdpa.fused_backends(q.device, cudnn):
        if allowed is None:
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=allowed[:, None], scale=scale)
    return out.transpose(1, 2).reshape(q_rows.numel(), q.shape[1], v.shape[2])


def causal_attention_packed_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cu: list[int],
                                 ranges: list[KeyRange], scale: float) -> torch.Tensor:
    B, dev = len(ranges), q.device
    q_lens = [b - a for a, b in zip(q_cu[:-1], q_cu[1:], strict=True)]
    k_lens = [k1 - k0 for k0, k1, _ in ranges]
    cudnn = sdpa.uses_cudnn(B, max(q_lens), max(k_lens))
    Lq, Lk = sdpa.padded_len(max(q_lens), cudnn), sdpa.padded_len(max(k_lens), cudnn)
    meta = to_device([q_cu[:-1], q_lens, [r[0] for r in ranges], k_lens, [r[2] for r in ranges]], dev)
    q_start, q_len, k_start, k_len, offset = meta
    tq, tk = torch.arange(Lq, device=dev), torch.arange(Lk, device=dev)
    # Padded positions read the sequence's last row (finite values); their outputs are never gathered back.
    q_rows = q_start[:, None] + torch.minimum(tq[None, :], q_len[:, None] - 1)  # [B, Lq]
    k_rows = k_start[:, None] + torch.minimum(tk[None, :], k_len[:, None] - 1)  # [B, Lk]
    fresh = k_lens == q_lens and all(r[2] == 0 for r in ranges)
    if not fresh and B * Lq * Lk > MAX_MASK_ELEMENTS:
        return _per_sequence(q, k, v, q_cu, ranges, scale)
    # [B, Lq, Lk]; key 0 is always allowed (no empty row). A live query never reaches a padded key:
    # accepts() guarantees k1 - k0 >= offset + its queries, so causality alone stops it in time.
    allowed = None if fresh else tk[None, None, :] <= tq[None, :, None] + offset[:, None, None]
    out = _padded_sdpa(q, k, v, q_rows, k_rows, allowed, scale, cudnn)
    if all(n == Lq for n in q_lens):  # no padded query rows to drop
        return out
    return out.index_select(0, to_device([b * Lq + t for b, n in enumerate(q_lens) for t in range(n)], dev))


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cu: list[int], ranges: list[KeyRange],
                  scale: float) -> torch.Tensor:
    """A pack whose mask would pass MAX_MASK_ELEMENTS (a long prompt chunked over its cached prefix): one fused
    call per sequence, its causal mask aligned to the lower right (keys = prefix + queries), no mask tensor."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for i, (k0, k1, offset) in enumerate(ranges):
        q0, q1 = q_cu[i], q_cu[i + 1]
        keys = min(k1, k0 + offset + q1 - q0)  # accepts(): the keys this sequence's queries can see are all there
        out[q0:q1] = sdpa.causal_attention_sdpa(q[q0:q1].transpose(0, 1), k[k0:keys].transpose(0, 1),
                                                v[k0:keys].transpose(0, 1), offset, scale).transpose(0, 1)
    return out


def causal_attention_static_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: DeviceSeqlens,
                                  seg_ids: torch.Tensor, local_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """A static pack of fresh sequences (keys = queries), one sequence at a time over the offsets read back."""
    cu = seqlens.host()
    return causal_attention_packed_torch(q, k, v, cu, [(cu[i], cu[i + 1], 0) for i in range(len(cu) - 1)], scale)


def accepts_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: DeviceSeqlens, seg_ids: torch.Tensor,
                   local_pos: torch.Tensor, scale: float) -> str | None:
    if not q.is_cuda:
        return f"tensors are on {q.device}, not CUDA"
    if q.dtype not in _DTYPES:
        return f"activation dtype {q.dtype} is not one of {_DTYPES} (the exact fp32 path is the torch reference)"
    if not (q.shape[0] == k.shape[0] == v.shape[0] == seg_ids.shape[0] == local_pos.shape[0] == seqlens.num_tokens):
        return (f"a static pack of {seqlens.num_tokens} tokens got q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}, "
                f"{seg_ids.shape[0]} segment ids, {local_pos.shape[0]} offsets (its keys are its own queries)")
    return None


def causal_attention_static_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: DeviceSeqlens,
                                 seg_ids: torch.Tensor, local_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """causal_attention_packed_sdpa for a static pack of fresh sequences, with nothing from the host but the
    bucket's bounds: the pack padded to [num_seqs, max_len] by gathers computed on the device from `seqlens.cu`, one
    causal SDPA call, and each token's row gathered back by its (segment id, offset). Every shape is fixed by the
    bucket, so a captured graph replays it over any lengths the bounds admit. Padded positions (and the rows of
    empty trailing sequences) read a real row, so they stay finite; causality keeps every live query off them."""
    B, T = seqlens.num_seqs, seqlens.num_tokens
    cudnn = sdpa.uses_cudnn(B, seqlens.max_len, seqlens.max_len)
    L = sdpa.padded_len(seqlens.max_len, cudnn)
    cu = seqlens.cu
    start, n = cu[:-1], cu[1:] - cu[:-1]
    t = torch.arange(L, device=q.device)
    rows = (start[:, None] + torch.minimum(t[None, :], (n - 1).clamp(min=0)[:, None])).clamp(max=T - 1)  # [B, L]
    return _padded_sdpa(q, k, v, rows, rows, None, scale, cudnn).index_select(0, seg_ids * L + local_pos)
