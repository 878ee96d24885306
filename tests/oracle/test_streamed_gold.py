"""The streamed gold (one decoder layer at a time) gives the whole-model reference's logits bit for bit, in fp32
and fp64, on a Kimi-Linear and a K3 preset (block-residual state carried); a wrong layer order does not."""

from __future__ import annotations

import pytest
import torch

from k3verify.checkpoint.loader import load_into
from k3verify.oracle.k3_reference import K3Reference
from k3verify.oracle.streamed import StreamedReference
from k3verify.target import resolve_target


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_streamed_gold_equals_whole_model_gold(preset: str, dtype: torch.dtype) -> None:
    target = resolve_target(preset, None)
    tensors = target.weights()
    whole = K3Reference(target.cfg, dtype)
    load_into(whole, target.cfg, tensors)
    ids = torch.randint(0, target.cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(5))
    expected = whole(ids, capture=True)
    streamed = StreamedReference(target.cfg, tensors, dtype)
    got = streamed(ids, capture=True)
    assert got.logits.dtype == dtype and torch.equal(got.logits, expected.logits)
    assert got.captures.keys() == expected.captures.keys()
    assert all(torch.equal(got.captures[k], v) for k, v in expected.captures.items())
    layer_bytes = max(sum(p.numel() for n, p in whole.named_parameters() if n.startswith(f"model.layers.{i}."))
                      for i in range(target.cfg.num_hidden_layers)) * dtype.itemsize
    assert 0 < streamed.stats.peak_piece_bytes <= max(layer_bytes, target.cfg.vocab_size * target.cfg.hidden_size
                                                      * dtype.itemsize)
    assert all(p.is_meta for p in streamed.ref.parameters())  # nothing left materialised
    swapped = StreamedReference(target.cfg, tensors, dtype, layer_order=lambda n: [1, 0, *range(2, n)])
    assert not torch.equal(swapped(ids).logits, expected.logits)
