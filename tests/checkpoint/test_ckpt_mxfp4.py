"""MXFP4 codec against hand-computed codes, bytes and E8M0 exponents."""

from __future__ import annotations

import pytest
import torch

from k3verify.checkpoint import mxfp4


def _group(*head: float) -> torch.Tensor:
    """One 32-element row: `head` then zeros."""
    row = torch.zeros(1, 32)
    row[0, : len(head)] = torch.tensor(head)
    return row


def test_quantize_group_with_max_6_uses_exponent_zero_and_low_nibble_first() -> None:
    """[6, -6, .5, 1, 1.5, 2, 3, 4, -.5, 0…]: codes 7, 15, 1, 2, 3, 4, 5, 6, 9, 0 packed two per byte, low first."""
    packed, scale = mxfp4.quantize(_group(6, -6, 0.5, 1, 1.5, 2, 3, 4, -0.5))
    assert scale.tolist() == [[127]]  # 2^(127-127) = 1
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert packed[0, :5].tolist() == [0xF7, 0x21, 0x43, 0x65, 0x09]
    assert packed[0, 5:].tolist() == [0] * 11


def test_quantize_group_with_max_3_uses_exponent_minus_one() -> None:
    """max |w| = 3 -> 3/6 = 2^-1 -> E8M0 byte 126; values double before coding: 3 -> 6 (7), 0.25 -> 0.5 (1)."""
    packed, scale = mxfp4.quantize(_group(3, 0.25, -1.5))
    assert scale.tolist() == [[126]]
    assert packed[0, :2].tolist() == [0x17, 0x0D]  # codes 7, 1 | 13 (-3.0), 0


def test_quantize_group_with_max_12_uses_exponent_plus_one() -> None:
    packed, scale = mxfp4.quantize(_group(12, 1))
    assert scale.tolist() == [[128]]
    assert packed[0, 0].item() == 0x17  # 12/2 = 6 -> 7, 1/2 = 0.5 -> 1


def test_quantize_rounds_ties_to_the_smaller_magnitude() -> None:
    """2.5 sits between 2 and 3: the codec documents ties to the smaller code (2)."""
    packed, _ = mxfp4.quantize(_group(6, 2.5))
    assert packed[0, 0].item() == 0x47


def test_dequantize_hand_bytes() -> None:
    """0xF7 = codes (7, 15) = (6, -6); 0x21 = (0.5, 1); scaled by 2^(e-127)."""
    packed = torch.tensor([[0xF7, 0x21] + [0] * 14], dtype=torch.uint8)
    for byte, factor in ((127, 1.0), (128, 2.0), (125, 0.25)):
        w = mxfp4.dequantize(packed, torch.tensor([[byte]], dtype=torch.uint8))
        assert w[0, :4].tolist() == [6 * factor, -6 * factor, 0.5 * factor, 1 * factor]
        assert w[0, 4:].abs().sum().item() == 0


def test_representable_values_round_trip_exactly() -> None:
    """Every E2M1 value times a per-group power of two survives quantize -> dequantize bit-exactly."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    values = torch.tensor(mxfp4.E2M1_VALUES)[codes]
    values[:, 0] = 6.0  # pin each group's max so the exponent is the intended one
    values[:, 32] = -6.0
    exps = torch.tensor([[-3.0], [0.0], [2.0], [5.0]])
    w = values * torch.pow(2.0, exps)
    packed, scale = mxfp4.quantize(w)
    assert torch.equal(mxfp4.dequantize(packed, scale), w)


def test_dequantize_rejects_a_scale_of_the_wrong_shape() -> None:
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight_scale shape \(2, 2\)"):
        mxfp4.dequantize(packed, torch.zeros(2, 2, dtype=torch.uint8))
