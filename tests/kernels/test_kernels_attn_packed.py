"""The packed MLA prefill attention: its one-call SDPA path (run here on CPU in fp32, where SDPA also runs)
equals the one-sequence-at-a-time reference on equal, ragged and prefixed packs, at exact and at bucketed padded
lengths; a cross-sequence leak shows. The backend policy sends only large calls to cuDNN."""

from __future__ import annotations

import pytest
import torch

from k3verify.gates.checks.kernel_attn_packed import PACKS, _pack
from k3verify.kernels import attn as attn_ops
from k3verify.kernels.attn import packed, sdpa
from k3verify.kernels.registry import REGISTRY, TORCH


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
