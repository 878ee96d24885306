"""Gated MLPs (dense layer-0 MLP, shared experts) and the two GLU activations.

SiLU-GLU:  down(silu(gate(x)) * up(x)), in the activation dtype; gate and up run as one GEMM in half precision
(layers/fused.py).
SiTU-GLU (K3), in fp32:  a = b * tanh(g / b) * sigmoid(g);  u = b_lin * tanh(u / b_lin);  a * u, cast back.
`tile_tokens` runs the MLP over near-equal token tiles to bound the [T, intermediate] transient; rows
are independent, so the result is bit-identical to the untiled MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from k3verify.config import ModelConfig
from k3verify.serving.layers.fused import FusedLinears
from k3verify.serving.layers.linear import LinearFactory, linear

GluFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Tile edges sit on multiples of 16 rows and no tile is shorter than 16: on CPU, fp32 GEMMs take other
# kernels for M < 12 and vectorized elementwise ops treat a ragged tail differently, either of which
# would change bits relative to the untiled pass.
TILE_ALIGN = 16


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


def glu_activation(cfg: ModelConfig) -> GluFn:
    if cfg.hidden_act == "silu":
        return silu_glu
    if cfg.hidden_act == "situ":
        if cfg.situ_beta is None:
            raise ValueError("hidden_act 'situ' needs activation_situ_beta")
        beta, lin = cfg.situ_beta, cfg.situ_linear_beta
        return lambda g, u: situ_glu(g, u, beta, lin)
    raise ValueError(f"unknown hidden_act {cfg.hidden_act!r}; expected 'silu' or 'situ'")


def even_tiles(total: int, max_rows: int) -> list[tuple[int, int]]:
    """Split `total` rows into the fewest near-equal tiles of about `max_rows` rows. Sizes are rounded
    up to TILE_ALIGN; a short remainder is merged into the last tile."""
    if max_rows < TILE_ALIGN:
        raise ValueError(f"tile_tokens must be >= {TILE_ALIGN}; got {max_rows}")
    n = -(-total // max_rows)
    per_tile = -(-total // n)
    size = -(-per_tile // TILE_ALIGN) * TILE_ALIGN
    bounds = [(a, min(a + size, total)) for a in range(0, total, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < TILE_ALIGN:
        bounds[-2:] = [(bounds[-2][0], total)]
    return bounds


class GatedMLP(nn.Module):
    """out_linear builds down_proj (a tensor-parallel rank's reduces its partial sum over its columns)."""

    def __init__(self, cfg: ModelConfig, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, tile_tokens: int | None = None, *,
                 out_linear: LinearFactory = linear) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, dtype, device)
        self.up_proj = linear(hidden, intermediate, dtype, device)
        self.hidden = hidden
        self.down_proj = out_linear(intermediate, hidden, dtype, device)
        self.gate_up = FusedLinears([self.gate_proj, self.up_proj])  # one GEMM in half precision
        self.act = glu_activation(cfg)
        if tile_tokens is not None and tile_tokens < TILE_ALIGN:
            raise ValueError(f"tile_tokens must be >= {TILE_ALIGN}; got {tile_tokens}")
        self.tile_tokens = tile_tokens

    def _glu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(self.act(gate, up))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens is None or x.shape[0] <= self.tile_tokens:
            return self._glu(x)
        out = x.new_empty(x.shape[0], self.hidden)
        for a, b in even_tiles(x.shape[0], self.tile_tokens):
            out[a:b] = self._glu(x[a:b])
        return out
