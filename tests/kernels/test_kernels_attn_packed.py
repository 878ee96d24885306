"""The packed MLA prefill attention: its one-call SDPA path (run here on CPU in fp32, where SDPA also runs)
equals the one-sequence-at-a-time reference on equal, ragged and prefixed packs, at exact and at bucketed padded
lengths; a cross-sequence leak shows. The backend policy sends only large calls to cuDNN."""

from __future__ import annotations

import pytest
import torch

from k3verify.gates import Kind, compare
from k3verify.gates.checks.kernels.attn_packed import PACKS, _pack
from k3verify.kernels import attn as attn_ops
from k3verify.kernels.attn import packed, sdpa
from k3verify.kernels.registry import CUDA, REGISTRY, TORCH


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
@pytest.mark.parametrize("name", sorted(PACKS))
def test_one_call_sdpa_equals_per_sequence_reference(name: str, bucketed: bool, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    if bucketed:  # every call takes the cuDNN sizing: lengths padded up to a bucket of 16
        monkeypatch.setattr(sdpa, "CUDNN_MIN_SCORES", 0)
        monkeypatch.setattr(sdpa, "CUDNN_LEN_BUCKET", 16)
    q, k, v, q_cu, ranges = _pack(torch.Generator().manual_seed(1), PACKS[name])
    ref = packed.causal_attention_packed_torch(q.double(), k.double(), v.double(), q_cu, ranges, 0.3)
    got = packed.causal_attention_packed_sdpa(q, k, v, q_cu, ranges, 0.3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    leaky = [(k0, k1 + 1, off + 1) if k1 < k.shape[0] else (k0, k1, off) for k0, k1, off in ranges]
    assert (packed.causal_attention_packed_sdpa(q, k, v, q_cu, leaky, 0.3).double() - ref).abs().max() > 1e-2


def test_cpu_routes_the_packed_op_to_the_reference() -> None:
    q, k, v, q_cu, ranges = _pack(torch.Generator().manual_seed(2), PACKS["ragged"])
    out = attn_ops.causal_attention_packed(q, k, v, q_cu, ranges, 0.3)
    assert REGISTRY.last_backend[attn_ops.CAUSAL_PACKED] == TORCH
    assert torch.equal(out, packed.causal_attention_packed_torch(q, k, v, q_cu, ranges, 0.3))
    assert packed.accepts(q, k, v, q_cu, ranges, 0.3) is not None  # CPU: refused with a reason


def test_only_large_calls_reach_cudnn_and_their_lengths_are_bucketed() -> None:
    assert not sdpa.uses_cudnn(32, 128, 128) and not sdpa.uses_cudnn(64, 128, 128)  # the served prompts
    assert sdpa.uses_cudnn(1, 8192, 8192) and sdpa.uses_cudnn(1, 2048, 2048)
    assert sdpa.padded_len(8000, True) == 8192 and sdpa.padded_len(8192, True) == 8192
    assert sdpa.padded_len(100, False) == 100


@pytest.mark.gpu
def test_cuda_large_packs_take_the_cudnn_sizing_and_match() -> None:
    """Packs of more than CUDNN_MIN_SCORES at MLA's head dims (192 / 128, which cuDNN takes): fresh ragged and
    prefixed, padded to the 256 bucket; the bf16 CUDA path against the fp64 reference, and the one-key-late mask
    (control) far off. The gates' packed check runs toy head dims that cuDNN refuses: this is where cuDNN's
    bucketed path is held to the reference."""
    g = torch.Generator().manual_seed(3)
    for seqs in ([(2100, 0), (1500, 0)], [(700, 0), (1200, 900)]):
        q_cu, ranges, k_at = [0], [], 0
        for lq, prefix in seqs:
            q_cu.append(q_cu[-1] + lq)
            ranges.append((k_at, k_at + prefix + lq, prefix))
            k_at += prefix + lq
        q = torch.randn(q_cu[-1], 4, 192, generator=g)
        k, v = torch.randn(k_at, 4, 192, generator=g), torch.randn(k_at, 4, 128, generator=g)
        assert sdpa.uses_cudnn(len(seqs), max(n for n, _ in seqs), max(n + p for n, p in seqs))
        scale = 192**-0.5
        qb, kb, vb = (t.cuda().bfloat16() for t in (q, k, v))
        got = attn_ops.causal_attention_packed(qb, kb, vb, q_cu, ranges, scale)
        assert REGISTRY.last_backend[attn_ops.CAUSAL_PACKED] == CUDA, REGISTRY.fallbacks
        ref = packed.causal_attention_packed_torch(q.double(), k.double(), v.double(), q_cu, ranges, scale).float()
        assert compare(Kind.RMS, ref, got.float().cpu(), 1e-2).passed
        late = [(k0, k1 + 1, off + 1) if k1 < k.shape[0] else (k0, k1, off) for k0, k1, off in ranges]
        ctrl = packed.causal_attention_packed_sdpa(qb, kb, vb, q_cu, late, scale)
        assert not compare(Kind.RMS, ref, ctrl.float().cpu(), 1e-2).passed, "control: a late mask must show"
