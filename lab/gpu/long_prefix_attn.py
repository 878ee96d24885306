"""MLA prefill attention over a long cached prefix on one GPU: CUDA peak and time of the fused bf16 path (causal
mask aligned to the lower right, no mask tensor) against the dense [Lq, Lk] boolean mask it replaced, and of the
fp32 query-blocked reference; RMS of each against the fp32 reference. Prints one JSON line per case."""

from __future__ import annotations

import functools
import json
import sys
import time

import torch
import torch.nn.functional as F

from k3verify.kernels.attn import sdpa, torch_ref


def _peak(fn):  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**30, time.perf_counter() - t0


def dense_mask(q, k, v, offset, scale):  # type: ignore[no-untyped-def]
    Lq, Lk = q.shape[1], k.shape[1]
    allowed = torch.arange(Lk, device=q.device)[None, :] <= (torch.arange(Lq, device=q.device)[:, None] + offset)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, scale=scale)[0]


def case(total: int, heads: int = 32, d: int = 192, dv: int = 128, chunk: int = 8192) -> dict[str, object]:
    """The last prefill chunk of `total` tokens: `chunk` queries over every key so far."""
    offset, scale = total - chunk, d ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(heads, chunk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(heads, total, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(heads, total, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    ref, ref_gib, ref_s = _peak(functools.partial(torch_ref.causal_attention, q.float(), k.float(), v.float(),
                                                  offset, scale))
    new_call = functools.partial(sdpa.causal_attention_sdpa, q, k, v, offset, scale)
    old_call = functools.partial(dense_mask, q, k, v, offset, scale)
    new, _, _ = _peak(new_call)  # first calls warm the kernels up
    old, _, _ = _peak(old_call)
    _, new_gib, new_s = _peak(new_call)
    _, old_gib, old_s = _peak(old_call)
    norm = ref.pow(2).mean().sqrt()
    return {"card": torch.cuda.get_device_name(), "total_tokens": total, "chunk": chunk, "heads": heads,
            "query_block": torch_ref.query_block(heads, chunk, total), "fp32_blocked_peak_gib": round(ref_gib, 3),
            "fp32_blocked_s": round(ref_s, 3), "lower_right_peak_gib": round(new_gib, 3),
            "lower_right_s": round(new_s, 4), "lower_right_rms": float((new.float() - ref).pow(2).mean().sqrt() / norm),
            "dense_mask_peak_gib": round(old_gib, 3), "dense_mask_s": round(old_s, 4),
            "dense_mask_rms": float((old.float() - ref).pow(2).mean().sqrt() / norm)}


def main() -> None:
    for total in [int(a) for a in sys.argv[1:]] or [32768, 131072]:
        print(json.dumps(case(total)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
