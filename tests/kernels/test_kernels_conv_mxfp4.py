"""The packed causal conv against per-sequence F.conv1d, and the serving MXFP4 decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3verify.checkpoint import mxfp4 as ckpt_mxfp4
from k3verify.kernels.conv import causal_conv
from k3verify.kernels.mxfp4 import dequantize
from k3verify.serving.batch import PackedBatch


def _conv_reference(x: torch.Tensor, w: torch.Tensor, init: torch.Tensor | None) -> torch.Tensor:
    """One sequence [T, D] through conv1d on [init | x] (zeros when init is None), then SiLU."""
    W = w.shape[1]
    pad = torch.zeros(x.shape[1], W - 1, dtype=x.dtype) if init is None else init
    seq = torch.cat([pad, x.t()], dim=1)[None]  # [1, D, W-1+T]
    return F.silu(F.conv1d(seq.double(), w.double()[:, None, :], groups=x.shape[1]))[0].t().to(x.dtype)


def test_packed_conv_restarts_at_every_sequence() -> None:
    g = torch.Generator().manual_seed(0)
    lens, D, W = [5, 1, 9, 2], 6, 4
    x = torch.randn(sum(lens), D, generator=g, dtype=torch.float64)
    w = torch.randn(D, W, generator=g, dtype=torch.float64)
    b = PackedBatch.build(torch.zeros(sum(lens), dtype=torch.long), lens)
    y, final = causal_conv(x, w, b.seg_ids, b.local_pos, b.cu_seqlens, None)
    start = 0
    for i, n in enumerate(lens):
        assert torch.allclose(y[start:start + n], _conv_reference(x[start:start + n], w, None), atol=1e-12)
        tail = torch.cat([torch.zeros(W - 1, D, dtype=x.dtype), x[start:start + n]])[-(W - 1):].t()
        assert torch.equal(final[i], tail)
        start += n


def test_conv_windows_carry_a_continuation() -> None:
    """Splitting a sequence anywhere and feeding the first part's final window gives the one-pass output
    bit for bit (D = 32: rows fill whole unrolled SIMD blocks, so SiLU sees no ragged tail either way)."""
    g = torch.Generator().manual_seed(1)
    D, W, T = 32, 4, 11
    x, w = torch.randn(T, D, generator=g), torch.randn(D, W, generator=g)
    one = PackedBatch.build(torch.zeros(T, dtype=torch.long), [T])
    whole, _ = causal_conv(x, w, one.seg_ids, one.local_pos, one.cu_seqlens, None)
    for cut in (1, 2, 3, 7):
        a = PackedBatch.build(torch.zeros(cut, dtype=torch.long), [cut])
        b = PackedBatch.build(torch.zeros(T - cut, dtype=torch.long), [T - cut])
        y1, win = causal_conv(x[:cut], w, a.seg_ids, a.local_pos, a.cu_seqlens, None)
        y2, _ = causal_conv(x[cut:], w, b.seg_ids, b.local_pos, b.cu_seqlens, win)
        assert torch.equal(torch.cat([y1, y2]), whole), cut


def test_mxfp4_decode_equals_checkpoint_decode_on_every_byte() -> None:
    packed = torch.arange(256, dtype=torch.uint8).repeat(3, 1)  # every pair of codes
    scale = torch.tensor([[0] * 16, [127] * 16, [254] * 16], dtype=torch.uint8)
    ref = ckpt_mxfp4.dequantize(packed, scale, torch.float32, 32)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(packed, scale, dtype, 32), ref.to(dtype))
    assert dequantize(packed, scale, torch.float32, 32)[1, :2].tolist() == [0.0, 0.0]
    assert dequantize(packed[:, 1:2], scale[:, :1].expand(3, 1), torch.float32, 2)[1].tolist() == [0.5, 0.0]
