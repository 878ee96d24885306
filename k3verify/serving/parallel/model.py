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

import torch
from torch import nn

from k3verify.config import ModelConfig
from k3verify.serving.kv_cache import PagedLatentCache
from k3verify.serving.layers.decoder import DecoderLayer
from k3verify.serving.layers.embed import Embedding, LMHead
from k3verify.serving.layers.moe import SparseMoE, resolve_mxfp4_mode
from k3verify.serving.model import KimiModel, ServingModel
from k3verify.serving.parallel.comm import Comm
from k3verify.serving.parallel.layers import VocabParallelEmbedding, VocabParallelLMHead, tp_attention, tp_mlp
from k3verify.serving.parallel.layout import check_layout, local_config
from k3verify.serving.parallel.moe import ParallelMoE
from k3verify.serving.parallel.shards import SliceSpec, load_rank
from k3verify.serving.state_cache import KDAStatePool

META = torch.device("meta")


def parallel_decoder_layer(cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, mxfp4_mode: str,
                           tile_tokens: int | None, comm: Comm) -> DecoderLayer:
    """A DecoderLayer, on meta, with this rank's attention heads, FFN columns and experts as its parts."""
    layout, local = comm.layout, local_config(cfg, comm.layout)
    attn: nn.Module | None = None
    ffn: nn.Module | None = None
    if layout.tp > 1:
        attn = tp_attention(local, layer_idx, dtype, META, comm)
        if not cfg.is_moe_layer(layer_idx):
            ffn = tp_mlp(cfg, cfg.hidden_size, cfg.intermediate_size, dtype, META, tile_tokens, comm)
    if cfg.is_moe_layer(layer_idx) and layout.world > 1:
        ffn = ParallelMoE(cfg, dtype, META, mxfp4_mode, tile_tokens, comm)
    return DecoderLayer(local, layer_idx, dtype, META, mxfp4_mode, tile_tokens, self_attn=attn, ffn=ffn)


def parallel_kimi_model(cfg: ModelConfig, dtype: torch.dtype, mxfp4_mode: str, tile_tokens: int | None,
                        comm: Comm) -> KimiModel:
    """KimiModel's attributes (same names, so the same checkpoint names) at this rank's width, on meta."""
    if comm.layout.tp > 1:
        embed: nn.Module = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, META, comm)
    else:
        embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, META)
    layers = [parallel_decoder_layer(cfg, i, dtype, mxfp4_mode, tile_tokens, comm)
              for i in range(cfg.num_hidden_layers)]
    return KimiModel(cfg, dtype, META, mxfp4_mode, tile_tokens, embed_tokens=embed, layers=layers)


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
        self.model = parallel_kimi_model(cfg, dtype, mxfp4_mode, tile_tokens, comm)
        if comm.layout.tp > 1:
            self.lm_head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype, META, comm)
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
