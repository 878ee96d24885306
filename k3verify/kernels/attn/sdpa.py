"""The same causal attention through torch's fused scaled_dot_product_attention (CUDA, bf16/fp16).

The eager reference materialises [h, Lq, Lk] scores in bf16 and their fp32 softmax: at 8k tokens
and 32 heads that is 12 GB of traffic per MLA layer. SDPA (memory-efficient / cuDNN backends; MLA's
value head dim differs from the key's, which rules FlashAttention-2 out) streams it instead. Other
accumulation order, so it is held to the oracle by RMS gates, never bit-exactly.

Which fused backend (`fused_backends`): where torch picks cuDNN, cuDNN builds an execution graph for every new shape,
per thread, at a host cost hundreds of times a cached call's. A served prefill step brings a new (batch, length) almost
every time, so that build would dominate a small prefill step. The memory-efficient kernel builds nothing and is close
to cuDNN's GPU time up to a few million scores, but several times slower at one long sequence: calls of at least
CUDNN_MIN_SCORES (batch x queries x keys) go to cuDNN with their lengths rounded up to a multiple of CUDNN_LEN_BUCKET,
so prompts of nearby lengths share one graph; smaller calls never reach it. Flash attention (no build either) takes what
it can; the math backend only shapes no fused kernel takes (the gates' toy head dims, not a multiple of 8: the
memory-efficient kernel refuses them).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_DTYPES = (torch.bfloat16, torch.float16)
CUDNN_MIN_SCORES = 1 << 22  # batch x queries x keys: one 2k sequence, 32 of 362 tokens
CUDNN_LEN_BUCKET = 256


def uses_cudnn(batch: int, lq: int, lk: int) -> bool:
    return batch * lq * lk >= CUDNN_MIN_SCORES


def padded_len(n: int, cudnn: bool) -> int:
    """The length a fused call pads n queries or keys to: a CUDNN_LEN_BUCKET multiple for cuDNN, else n."""
    return math.ceil(n / CUDNN_LEN_BUCKET) * CUDNN_LEN_BUCKET if cudnn else n


def fused_backends(device: torch.device, cudnn: bool) -> contextlib.AbstractContextManager[None]:
    """The backends a CUDA call may take, in torch's order of preference among them (torch's own choice on CPU)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    fallbacks = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, *fallbacks] if cudnn else fallbacks)


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
    Lq, Lk = q.shape[1], k.shape[1]
    with fused_backends(q.device, uses_cudnn(1, Lq, Lk)):
        if offset == 0:  # fresh sequence: square causal mask, no mask tensor needed
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]
        if Lk == offset + Lq:  # what accepts() admits: "query t sees keys 0..offset+t" is the causal mask aligned
            # to the lower right, so no [Lq, Lk] mask tensor (over a 128K prefix it would be 16 GB per chunk)
            from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: here, not at start-up

            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal_lower_right(Lq, Lk),
                                                  scale=scale)[0]
        allowed = torch.arange(Lk, device=q.device)[None, :] <= (torch.arange(Lq, device=q.device)[:, None] + offset)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, scale=scale)[0]
