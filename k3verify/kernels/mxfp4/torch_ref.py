"""MXFP4 decode in torch: E2M1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) x 2^(e8m0 - 127).

Each byte holds two codes, the LOW nibble first. E2M1 magnitudes have at most two significant bits,
so value x power-of-two scale is exact in fp32 and bf16 (same exponent range): decoding straight
into the activation dtype loses nothing.
"""

from __future__ import annotations

import torch

# magnitude of each 3-bit code: subnormal 0, 0.5, then 2^(e-1) * (1 + m/2)
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def codes_low_first(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n]; element 2i is the low nibble of byte i."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def dequantize_torch(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     group_size: int) -> torch.Tensor:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"mxfp4 tensors must be uint8; got packed {packed.dtype}, scale {scale.dtype}")
    codes = codes_low_first(packed)
    rows, n = codes.shape
    if n % group_size or scale.shape != (rows, n // group_size):
        raise ValueError(f"mxfp4 scale {tuple(scale.shape)} does not fit packed {tuple(packed.shape)} "
                         f"with group {group_size}")
    mags = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=packed.device)
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).float()
    values = sign * mags[(codes & 0x7).long()]
    pow2 = torch.ldexp(torch.ones(scale.shape, device=packed.device), scale.to(torch.int32) - 127)
    out = values.view(rows, n // group_size, group_size) * pow2[..., None]
    return out.view(rows, n).to(dtype)


def grouped_mm_torch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor,
                     group: int) -> torch.Tensor:
    """x [M, K] rows sorted by expert; codes [E, N, K/2] uint8; scales [E, N, K/group] uint8; offs [E] int32,
    the end of each expert's rows -> y [M, N] in x.dtype, y[rows of e] = x[rows of e] @ dequantize(e)^T.

    The reference: each expert with rows dequantized into x's dtype (exact) and one F.linear; host-side
    offsets (a sync), so it is never captured in a CUDA graph."""
    E = codes.shape[0]
    if offs.shape != (E,):
        raise ValueError(f"offs must hold one end per expert ({E}); got shape {tuple(offs.shape)}")
    y = x.new_empty(x.shape[0], codes.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end < start or end > x.shape[0]:
            raise ValueError(f"offs {offs.tolist()} are not non-decreasing ends within {x.shape[0]} rows (expert {e})")
        if end > start:
            w = dequantize_torch(codes[e], scales[e], x.dtype, group)
            y[start:end] = torch.nn.functional.linear(x[start:end], w)
        start = end
    if start != x.shape[0]:
        raise ValueError(f"offs end at row {start} but x has {x.shape[0]} rows")
    return y
