"""One decoder layer: attention (KDA or MLA) + FFN (dense MLP or MoE), with either the plain
pre-norm residual (Kimi-Linear) or Block Attention Residuals (K3).

Block Attention Residuals, layer l with running partial sum p and block entries B:
  h = mix(p, B; attn pair) if B else p;  if l % block_size == 0: B.append(p), p = None
  a = attn(input_layernorm(h));  p = a if p is None else p + a
  h = mix(p, B; mlp pair);  f = ffn(post_attention_layernorm(h));  p = p + f
The mixed h only feeds the norms, never p.
"""

from __future__ import annotations

import torch
from torch import nn

from k3verify.config import ModelConfig
from k3verify.serving.context import ForwardContext
from k3verify.serving.layers.attn_res import BlockBuffer, ConcatBlocks, attn_res_mix
from k3verify.serving.layers.kda import KimiDeltaAttention
from k3verify.serving.layers.linear import linear
from k3verify.serving.layers.mla import MultiHeadLatentAttention
from k3verify.serving.layers.mlp import GatedMLP
from k3verify.serving.layers.moe import SparseMoE
from k3verify.serving.layers.norm import RMSNorm

Captures = dict[str, torch.Tensor] | None
Blocks = BlockBuffer | ConcatBlocks


class DecoderLayer(nn.Module):
    """self_attn and ffn, when given, are this layer's attention and its MLP or MoE block (a tensor-parallel rank's
    split ones); otherwise the layer builds them from cfg."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str | None,
                 mxfp4_mode: str, tile_tokens: int | None, *, self_attn: nn.Module | None = None,
                 ffn: nn.Module | None = None) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx, self.eps = layer_idx, eps
        self.block_size = cfg.attn_res_block_size
        self.input_layernorm = RMSNorm(H, eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, eps, dtype)
        if cfg.uses_attn_res:
            self.self_attention_res_norm = RMSNorm(H, eps, dtype)
            self.self_attention_res_proj = linear(H, 1, dtype, device)
            self.mlp_res_norm = RMSNorm(H, eps, dtype)
            self.mlp_res_proj = linear(H, 1, dtype, device)
        if self_attn is not None:
            self.self_attn: nn.Module = self_attn
        elif cfg.layer_kind(layer_idx) == "kda":
            self.self_attn = KimiDeltaAttention(cfg, layer_idx, dtype, device)
        else:
            self.self_attn = MultiHeadLatentAttention(cfg, layer_idx, dtype, device)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = ffn if ffn is not None else SparseMoE(cfg, dtype, device, mxfp4_mode, tile_tokens)
        else:
            self.mlp = ffn if ffn is not None else GatedMLP(cfg, H, cfg.intermediate_size, dtype, device, tile_tokens)

    @property
    def ffn_module(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_module(x)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, captures: Captures) -> torch.Tensor:
        """Plain residual stream x [T, H] -> x."""
        x, f = self.forward_deferred(x, None, ctx, captures)
        return x + f

    def forward_deferred(self, x: torch.Tensor, pending: torch.Tensor | None, ctx: ForwardContext,
                         captures: Captures) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain residual stream x + pending (pending: the previous layer's FFN output, not yet added) -> (x, f),
        the stream after the attention residual and this layer's FFN output, for the next norm to add. Each
        residual add runs inside the norm that follows it (RMSNorm.add_forward): the same bits as forward()."""
        x, h = self.input_layernorm.add_forward(x, pending)
        a = self.self_attn(h, ctx)
        x, h = self.post_attention_layernorm.add_forward(x, a)
        f = self.ffn(h)
        self._capture(captures, a, f)
        return x, f

    def forward_attn_res(self, p: torch.Tensor, blocks: Blocks, ctx: ForwardContext,
                         captures: Captures) -> torch.Tensor:
        """Partial sum p [T, H] and the pass's block entries -> new p (blocks may grow by one)."""
        assert self.block_size is not None
        h = p if blocks.n == 0 else self.mix(p, blocks, "self_attention_res")
        running: torch.Tensor | None = p
        if self.layer_idx % self.block_size == 0:
            blocks.append(p)
            running = None
        a = self.self_attn(self.input_layernorm(h), ctx)
        p = a if running is None else running + a
        h = self.mix(p, blocks, "mlp_res")
        f = self.ffn(self.post_attention_layernorm(h))
        self._capture(captures, a, f)
        return p + f

    def mix(self, p: torch.Tensor, blocks: Blocks, pair: str) -> torch.Tensor:
        norm, proj = getattr(self, f"{pair}_norm"), getattr(self, f"{pair}_proj")
        return attn_res_mix(p, blocks.view(), norm.weight, proj.weight, self.eps)

    def _capture(self, captures: Captures, a: torch.Tensor, f: torch.Tensor) -> None:
        if captures is not None:
            captures[f"layers.{self.layer_idx}.attn_out"] = a
            captures[f"layers.{self.layer_idx}.ffn_out"] = f
