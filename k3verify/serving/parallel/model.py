"""ParallelServingModel: one rank of the served model under a tensor/expert-parallel layout.

It is a ServingModel (the same forward, prefill, decode, caches and runner) whose layers are built at this
rank's width (serving/parallel/layers.py, moe.py) and which launch their collectives themselves; every rank
runs the same batch and ends with the same [B, V] fp32 logits. The model is built on the meta device and
materialized once at its own size, so no rank ever allocates the unsplit model; weights are then read
slice by slice from the checkpoint (shards.load_rank). KDA states are cached for this rank's heads only;
the MLA latent is head-independent, so each rank caches it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from k3verify.config import ModelConfig
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.layers.decoder import DecoderLayer
from k3verify.serving.layers.embed import Embedding, LMHead
from k3verify.serving.layers.linear import linear
from k3verify.serving.layers.moe import SparseMoE, resolve_mxfp4_mode
from k3verify.serving.layers.norm import RMSNorm
from k3verify.serving.model import KimiModel, ServingModel
from k3verify.serving.parallel.comm import Comm
from k3verify.serving.parallel.layers import (
    TPGatedMLP,
    TPKimiDeltaAttention,
    TPMultiHeadLatentAttention,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from k3verify.serving.parallel.layout import check_layout, local_config
from k3verify.serving.parallel.moe import ParallelMoE
from k3verify.serving.parallel.shards import SliceSpec, load_rank
from k3verify.serving.state_cache import KDAStatePool

META = torch.device("meta")


class ParallelDecoderLayer(DecoderLayer):
    """DecoderLayer with this rank's attention heads, FFN columns and experts (forward is DecoderLayer's)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, mxfp4_mode: str,
                 tile_tokens: int | None, comm: Comm) -> None:
        layout, local = comm.layout, local_config(cfg, comm.layout)
        # Built on meta at the local head counts; the parts that collect a partial sum are swapped in (with more
        # than one rank the MoE block is ParallelMoE, so DecoderLayer's own is built without experts).
        experts = cfg.num_experts if layout.world == 1 else 0
        super().__init__(replace(local, num_experts=experts), layer_idx, dtype, META, mxfp4_mode, tile_tokens)
        if layout.tp > 1:
            attn = TPKimiDeltaAttention if cfg.layer_kind(layer_idx) == "kda" else TPMultiHeadLatentAttention
            self.self_attn = attn(local, layer_idx, dtype, META, comm)
            if not self.is_moe:
                self.mlp = TPGatedMLP(cfg, cfg.hidden_size, cfg.intermediate_size, dtype, META, tile_tokens, comm)
        if self.is_moe and layout.world > 1:
            self.block_sparse_moe = ParallelMoE(cfg, dtype, META, mxfp4_mode, tile_tokens, comm)


class ParallelKimiModel(KimiModel):
    """KimiModel's attributes (same names, so the same checkpoint names) at this rank's width."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, mxfp4_mode: str, tile_tokens: int | None,
                 comm: Comm) -> None:
        nn.Module.__init__(self)  # KimiModel.__init__ would build the unsplit layers
        H = cfg.hidden_size
        if comm.layout.tp > 1:
            self.embed_tokens: Embedding = VocabParallelEmbedding(cfg.vocab_size, H, dtype, META, comm)
        else:
            self.embed_tokens = Embedding(cfg.vocab_size, H, dtype, META)
        self.layers = nn.ModuleList(ParallelDecoderLayer(cfg, i, dtype, mxfp4_mode, tile_tokens, comm)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
        if cfg.uses_attn_res:
            self.output_attn_res_norm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.output_attn_res_proj = linear(H, 1, dtype, META)


class ParallelServingModel(ServingModel):
    def __init__(self, cfg: ModelConfig, comm: Comm, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", mxfp4_mode: str = "auto", *, tile_tokens: int | None = None,
                 mla_absorb: bool = True) -> None:
        nn.Module.__init__(self)  # ServingModel.__init__ would build the unsplit model
        check_layout(cfg, comm.layout)
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.comm, self.layout, self.local_cfg = comm, comm.layout, local_config(cfg, comm.layout)
        self.mla_absorb = mla_absorb
        self.attn_res_storage = "prealloc"
        mxfp4_mode = self.mxfp4_mode = resolve_mxfp4_mode(mxfp4_mode, cfg.experts_quantized, dtype, self.device)
        # Large tensors are created on meta; the few small ones built without a device argument (norm gains,
        # conv weights, A_log, dt_bias) on the CPU. to_empty then gives every one its storage on the target
        # device, uninitialized: load() fills all of them or raises.
        self.model = ParallelKimiModel(cfg, dtype, mxfp4_mode, tile_tokens, comm)
        if comm.layout.tp > 1:
            self.lm_head: LMHead = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype, META, comm)
        else:
            self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, dtype, META)
        self.to_empty(device=self.device)
        self.kv_cache: PagedLatentCache | None = None
        self.state_pool: KDAStatePool | None = None
        self.slice_specs: dict[str, SliceSpec] = {}

    def load(self, tensors: Mapping[str, torch.Tensor]) -> ParallelServingModel:
        """Fill this rank's parameters from their checkpoint slices, strictly (shards.load_rank); from a
        CheckpointReader only the slices' bytes are read."""
        self.slice_specs = load_rank(self, self.cfg, self.layout, tensors)
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.invalidate()
        return self

    def allocate_caches(self, num_pages: int, page_size: int, num_slots: int) -> None:
        self.kv_cache = PagedLatentCache(self.local_cfg, num_pages, page_size, self.dtype, self.device)
        self.state_pool = KDAStatePool(self.local_cfg, num_slots, self.device)

    def moe_layers(self) -> list[ParallelMoE]:
        return [m for m in self.modules() if isinstance(m, ParallelMoE)]
