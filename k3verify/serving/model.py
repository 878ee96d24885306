"""ServingModel: the Kimi-Linear / Kimi-K3 text model as served — packed prefill, decode, caches.

Module attribute paths equal checkpoint names (`model.layers.3.self_attn.q_proj.weight`, MXFP4
experts as `...experts.7.w1.weight_packed`), so loading is checkpoint.loader.load_into.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from k3verify.checkpoint.loader import load_into
from k3verify.config import ModelConfig
from k3verify.serving.batch import PackedBatch
from k3verify.serving.context import ForwardContext
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.layers.attn_res import BlockBuffer, ConcatBlocks, attn_res_mix, num_blocks
from k3verify.serving.layers.decoder import Blocks, DecoderLayer
from k3verify.serving.layers.embed import Embedding, LMHead
from k3verify.serving.layers.linear import linear
from k3verify.serving.layers.moe import SparseMoE, resolve_mxfp4_mode
from k3verify.serving.layers.norm import RMSNorm
from k3verify.serving.prefix_pages import SharedLatentCache
from k3verify.serving.spec.arena import ScorePass
from k3verify.serving.state_cache import KDAStatePool

ATTN_RES_STORAGE = ("prealloc", "concat")


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, V] fp32, each sequence's last token ([T, V] for a score pass)
    all_logits: torch.Tensor | None = None  # [T, V] fp32 when asked for
    captures: dict[str, torch.Tensor] | None = None  # layers.{i}.attn_out / ffn_out, final_hidden: [T, H]
    stats: dict[str, int] | None = None  # engagement counters (segmented KDA, absorbed decode, ...)


class KimiModel(nn.Module):
    """embed_tokens and layers, when given, are the embedding and the decoder layers (a tensor-parallel rank's
    split ones); otherwise the model builds them from cfg."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str | None, mxfp4_mode: str,
                 tile_tokens: int | None, *, embed_tokens: nn.Module | None = None,
                 layers: Sequence[DecoderLayer] | None = None) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.embed_tokens = embed_tokens if embed_tokens is not None else Embedding(cfg.vocab_size, H, dtype, device)
        if layers is None:
            layers = [DecoderLayer(cfg, i, dtype, device, mxfp4_mode, tile_tokens)
                      for i in range(cfg.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        if cfg.uses_attn_res:
            self.output_attn_res_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.output_attn_res_proj = linear(H, 1, dtype, device)

    def decoder_layers(self) -> list[DecoderLayer]:
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        if len(layers) != len(self.layers):
            raise TypeError("KimiModel.layers holds a module that is not a DecoderLayer")
        return layers


class ServingModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 mxfp4_mode: str = "auto", *, tile_tokens: int | None = None, mla_absorb: bool = True) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.mla_absorb = mla_absorb
        self.attn_res_storage = "prealloc"
        self.mxfp4_mode = resolve_mxfp4_mode(mxfp4_mode, cfg.experts_quantized, dtype, self.device)
        self.model = KimiModel(cfg, dtype, self.device, self.mxfp4_mode, tile_tokens)
        self.lm_head: nn.Module = LMHead(cfg.hidden_size, cfg.vocab_size, dtype, self.device)
        self.to(self.device)
        self.kv_cache: PagedLatentCache | None = None
        self.state_pool: KDAStatePool | None = None

    def load(self, tensors: Mapping[str, torch.Tensor]) -> ServingModel:
        """Strictly load checkpoint tensors (checkpoint names) and drop any dequantized expert cache."""
        load_into(self, self.cfg, tensors)
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.invalidate()
        return self

    def allocate_caches(self, num_pages: int, page_size: int, num_slots: int) -> None:
        self.kv_cache = SharedLatentCache(self.cfg, num_pages, page_size, self.dtype, self.device)
        self.state_pool = KDAStatePool(self.cfg, num_slots, self.device)

    @torch.no_grad()
    def prefill(self, batch: PackedBatch, *, all_logits: bool = False, capture: bool = False,
                segment_len: int | None = None) -> ForwardOutput:
        """Run a pack. With slots / page tables in the batch the caches are read (continuations) and
        written; without, the pass is self-contained and caches nothing."""
        ctx = self._context(batch, segment_len)
        return self._forward(ctx, all_logits, capture)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, slots: Sequence[int], page_tables: Sequence[Sequence[int]],
               positions: Sequence[int]) -> torch.Tensor:
        """One new token per sequence at `positions` (= tokens already cached) -> [B, V] fp32 logits."""
        if self.kv_cache is None:
            raise RuntimeError("decode needs caches: call allocate_caches first")
        batch = PackedBatch.build(input_ids, [1] * len(positions), start_pos=positions, slots=slots,
                                  page_tables=page_tables, page_size=self.kv_cache.page_size, is_decode=True,
                                  device=self.device)
        return self._forward(self._context(batch, None), False, False).logits

    @torch.no_grad()
    def score(self, batch: PackedBatch, score: ScorePass) -> torch.Tensor:
        """A speculative score pack (B continuing sequences x n tokens: the last accepted token and k drafts)
        -> [B * n, V] fp32 logits of every token. KDA layers record every position into score.arena and leave
        the pool untouched; MLA layers write every token's latent (serving.spec.arena.commit_accepted settles
        both once the accepted prefix is known)."""
        if self.kv_cache is None or self.state_pool is None:
            raise RuntimeError("score needs caches: call allocate_caches first")
        if batch.slots is None or batch.page_table is None or batch.is_decode:
            raise ValueError("a score pack needs slots and page tables and is not a decode pack")
        if any(n != score.num_positions for n in batch.seq_lens):
            raise ValueError(f"every sequence of a score pack has {score.num_positions} tokens; got {batch.seq_lens}")
        ctx = self._context(batch, None)
        ctx.score = score
        return self._forward(ctx, False, False).logits

    def _context(self, batch: PackedBatch, segment_len: int | None) -> ForwardContext:
        cached = batch.slots is not None or batch.page_table is not None
        if cached and (self.kv_cache is None or self.state_pool is None):
            raise RuntimeError("the batch names state slots / pages but the model has no caches")
        if cached and self.cfg.has_kda and batch.slots is None:
            raise ValueError("a cached pass over KDA layers needs batch.slots")
        if cached and self.cfg.has_mla and batch.page_table is None:
            raise ValueError("a cached pass over MLA layers needs batch.page_table")
        ctx = ForwardContext(batch, self.kv_cache if cached else None, self.state_pool if cached else None,
                             segment_len=segment_len, mla_absorb=self.mla_absorb)
        if ctx.kv_cache is not None and batch.page_table is not None:
            ctx.kv_rows = ctx.kv_cache.rows(batch.page_table, batch.seg_ids, batch.positions)
        return ctx

    def _forward(self, ctx: ForwardContext, all_logits: bool, capture: bool) -> ForwardOutput:
        b, cfg = ctx.batch, self.cfg
        captures: dict[str, torch.Tensor] | None = {} if capture else None
        x = self.model.embed_tokens(b.input_ids)
        if cfg.uses_attn_res:
            blocks = self._new_blocks(x, ctx)
            for layer in self.model.decoder_layers():
                x = layer.forward_attn_res(x, blocks, ctx, captures)
            h = self.finish(x, blocks)
            del blocks  # the per-pass block buffer is released here
        else:
            pending: torch.Tensor | None = None  # each layer's FFN output, added inside the next norm
            for layer in self.model.decoder_layers():
                x, pending = layer.forward_deferred(x, pending, ctx, captures)
            h = self.finish(x, None, pending)
        if captures is not None:
            captures["final_hidden"] = h
        # a score pass needs every token's logits; anything else only each sequence's last
        logits = self.lm_head(h if ctx.score is not None else h.index_select(0, b.last_token_index))
        return ForwardOutput(logits, self.lm_head(h) if all_logits else None, captures, ctx.stats)

    def finish(self, x: torch.Tensor, blocks: Blocks | None, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Residual stream -> lm_head input: mix-then-norm with Block Attention Residuals, else norm (of x + pending,
        the last layer's FFN output, added inside the norm)."""
        if blocks is not None:
            if pending is not None:
                raise ValueError("Block Attention Residuals add every FFN output in the layer; nothing is pending")
            x = attn_res_mix(x, blocks.view(), self.model.output_attn_res_norm.weight,
                             self.model.output_attn_res_proj.weight, self.cfg.rms_norm_eps)
            return self.model.norm(x)
        return self.model.norm.add_forward(x, pending)[1]

    def _new_blocks(self, x: torch.Tensor, ctx: ForwardContext) -> Blocks:
        if self.attn_res_storage == "prealloc":
            ctx.bump("attn_res_prealloc")
            return BlockBuffer(x.shape[0], num_blocks(self.cfg), x.shape[1], x.dtype, x.device)
        if self.attn_res_storage == "concat":
            return ConcatBlocks()
        raise ValueError(f"attn_res_storage must be one of {ATTN_RES_STORAGE}; got {self.attn_res_storage!r}")


def build_model(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu", mxfp4_mode: str = "auto", tile_tokens: int | None = None,
                mla_absorb: bool = True) -> ServingModel:
    return ServingModel(cfg, dtype, device, mxfp4_mode, tile_tokens=tile_tokens, mla_absorb=mla_absorb).load(tensors)
