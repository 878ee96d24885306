"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`): E2M1 codes, two per byte, low nibble first,
plus one E8M0 scale byte (2^(e-127)) per 32 consecutive input elements of each output row."""

from __future__ import annotations

import torch

GROUP = 32
# E2M1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0


def _lut(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def decode_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n] (low nibble is the earlier element)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"weight_packed must be uint8; got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               group_size: int = GROUP) -> torch.Tensor:
    """[out, in/2] uint8 codes + [out, in/group] uint8 E8M0 exponents -> [out, in] weights (exact in fp32)."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"weight_scale must be uint8 (E8M0); got {scale.dtype}")
    codes = decode_codes(packed)
    out, n = codes.shape
    if scale.shape != (out, n // group_size):
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
                         f"with group {group_size}: expected {(out, n // group_size)}")
    values = _lut(codes.device)[codes.long()]
    exps = scale.to(torch.int32) - 127
    factors = torch.pow(2.0, exps.to(torch.float32))
    w = values.view(out, n // group_size, group_size) * factors[..., None]
    return w.view(out, n).to(dtype)


def quantize(w: torch.Tensor, group_size: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed uint8 [out, in/2], scale uint8 [out, in/group]).

    The shared exponent is the smallest that puts the group's max |w| within E2M1's range (≤ 6);
    each element rounds to the nearest E2M1 value (ties to the smaller magnitude code)."""
    out, n = w.shape
    if n % group_size:
        raise ValueError(f"input width {n} is not a multiple of the mxfp4 group {group_size}")
    g = w.detach().to(torch.float32).reshape(out, n // group_size, group_size)
    amax = g.abs().amax(dim=-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp)[..., None]
    mags = _lut(w.device)[:8]
    dist = (scaled.abs()[..., None] - mags).abs()
    code = dist.argmin(dim=-1).to(torch.uint8)  # argmin takes the first minimum: the smaller magnitude
    code = code | ((scaled < 0) & (code > 0)).to(torch.uint8) << 3
    code = code.reshape(out, n)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    scale = (exp + 127).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()
