"""The same causal attention through torch's fused scaled_dot_product_attention (CUDA, bf16/fp16).

The eager reference materialises [h, Lq, Lk] scores in bf16 and their fp32 softmax: at 8k tokens
and 32 heads that is 12 GB of traffic per MLA layer. SDPA (memory-efficient / cuDNN backends; MLA's
value head dim differs from the key's, which rules FlashAttention-2 out) streams it instead. Other
accumulation order, so it is held to the oracle by RMS gates, never bit-exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DTYPES = (torch.bfloat16, torch.float16)


def accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> str | None:
    if not q.is_cuda:
        return f"tensors are on {q.device}, not CUDA"
    if q.dtype not in _DTYPES:
        return f"activation dtype {q.dtype} is not one of {_DTYPES} (the exact fp32 path is the torch reference)"
    if k.shape[1] != offset + q.shape[1]:
        return (f"{k.shape[1]} keys for {q.shape[1]} queries at offset {offset}: the keys must be the cached "
                "prefix plus the queries")
    return None


def causal_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float
                          ) -> torch.Tensor:
    if offset == 0:  # fresh sequence: square causal mask, no mask tensor needed
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]
    Lq, Lk = q.shape[1], k.shape[1]
    allowed = torch.arange(Lk, device=q.device)[None, :] <= (torch.arange(Lq, device=q.device)[:, None] + offset)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, scale=scale)[0]
