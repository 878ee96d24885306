"""MLA prefill attention: the fused SDPA path computes the eager reference's causal attention, for
fresh sequences and for continuations over a cached prefix; a mask one position off is caught."""

from __future__ import annotations

import pytest
import torch

from k3verify.gates import Kind, compare
from k3verify.kernels import attn
from k3verify.kernels.attn import sdpa, torch_ref
from k3verify.kernels.registry import CUDA, REGISTRY, TORCH


def _qkv(Lq: int, offset: int, device: str = "cpu", dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(Lq * 31 + offset)
    h, d, dv = 4, 24, 16  # MLA: value head dim differs from the key's
    q, k = torch.randn(h, Lq, d, generator=g), torch.randn(h, offset + Lq, d, generator=g)
    v = torch.randn(h, offset + Lq, dv, generator=g)
    return (t.to(device, dtype) for t in (q, k, v))


@pytest.mark.parametrize(("Lq", "offset"), [(1, 0), (37, 0), (19, 23), (1, 40)])
def test_sdpa_path_matches_the_reference(Lq: int, offset: int) -> None:
    q, k, v = _qkv(Lq, offset)
    scale = 24**-0.5
    ref = torch_ref.causal_attention(q, k, v, offset, scale)
    got = sdpa.causal_attention_sdpa(q, k, v, offset, scale)
    assert compare(Kind.RMS, ref, got, 1e-5).passed
    if Lq > 1:  # control: a mask one position late (each query sees the next key too) must fail the bar
        assert not compare(Kind.RMS, ref, sdpa.causal_attention_sdpa(q, k, v, offset + 1, scale), 1e-5).passed


def test_sdpa_refuses_cpu_tensors_with_a_reason() -> None:
    q, k, v = _qkv(5, 3)
    assert "not CUDA" in (sdpa.accepts(q, k, v, 3, 1.0) or "")


def test_cpu_routes_to_the_reference() -> None:
    q, k, v = _qkv(6, 0)
    attn.causal_attention(q, k, v, 0, 0.2)
    assert REGISTRY.last_backend[attn.CAUSAL] == TORCH


@pytest.mark.gpu
def test_cuda_routes_to_sdpa_and_matches() -> None:
    for Lq, offset in ((64, 0), (33, 17)):
        q, k, v = _qkv(Lq, offset, "cuda", torch.bfloat16)
        got = attn.causal_attention(q, k, v, offset, 0.2)
        assert REGISTRY.last_backend[attn.CAUSAL] == CUDA, REGISTRY.fallbacks
        ref = torch_ref.causal_attention(q.float(), k.float(), v.float(), offset, 0.2)
        assert compare(Kind.RMS, ref, got.float(), 1e-2).passed
    q, k, v = _qkv(8, 4, "cuda", torch.bfloat16)
    assert "keys must" in (sdpa.accepts(q, k, v, 2, 1.0) or "")
