"""The bandwidth floor: bytes that must move per decode step, over measured copy bandwidth.

Counted per step at batch B and context C (bf16 weights, fp32 KDA state):
- every non-expert weight that a token touches (attention, norms, router, shared experts, dense MLP,
  lm_head) once per step; the embedding contributes B rows, not the table;
- routed experts: the distinct experts touched per MoE layer, each read once — as measured in the run
  (the bench counts them), or E·(1−(1−k/E)^B) under uniform routing; in bf16, or for MXFP4 experts
  served packed, as stored (half a byte per weight plus one scale byte per group);
- KDA recurrent state read and written (fp32) and conv windows, per sequence and KDA layer;
- the MLA latent cache read (C tokens × (kv_lora + rope)) per sequence and MLA layer.
GPU.md's "3.1 GB" for kl-48b-8l counts the whole embedding table too; we do not, so our floor is
lower and the fraction we report is the stricter one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3verify.checkpoint.names import TensorSpec, module_specs
from k3verify.config import ModelConfig


@dataclass(frozen=True)
class FloorBytes:
    dense_weights: int
    expert_weights: int
    kda_state: int
    mla_cache: int
    embedding_rows: int

    @property
    def total(self) -> int:
        return self.dense_weights + self.expert_weights + self.kda_state + self.mla_cache + self.embedding_rows


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def _expert_bytes(name: str, spec: TensorSpec, weight_bytes: int, packed: bool) -> int:
    """Bytes one stored expert tensor costs a step: MXFP4 codes / scales as stored when served packed,
    else the dense weights they decode to (codes hold two weights a byte; scales vanish)."""
    n = math.prod(spec.shape)
    if spec.dtype != torch.uint8:
        if packed:
            raise ValueError(f"{name} is dense ({spec.dtype}): only MXFP4 experts can be read packed")
        return n * weight_bytes
    if packed:
        return n
    return 2 * n * weight_bytes if name.endswith(".weight_packed") else 0


def expert_bytes(cfg: ModelConfig, packed: bool, weight_bytes: int = 2) -> int:
    """Bytes one routed expert (w1, w2, w3 of one layer) costs to read."""
    specs = module_specs(cfg)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    prefix = f"model.layers.{layer}.block_sparse_moe.experts.0."
    return sum(_expert_bytes(n, s, weight_bytes, packed) for n, s in specs.items() if n.startswith(prefix))


def decode_floor_bytes(cfg: ModelConfig, batch: int, context: int, weight_bytes: int = 2,
                       distinct_experts: float | None = None, packed_experts: bool = False) -> FloorBytes:
    """`distinct_experts`: experts touched per MoE layer and step as measured in the run (routing of real
    or synthetic weights is rarely uniform); None assumes uniform routing, E·(1−(1−k/E)^B).
    `packed_experts`: MXFP4 experts are read as stored (codes + scales), else as the `weight_bytes` they
    dequantize to."""
    specs = module_specs(cfg)
    dense = expert_one = 0
    for name, spec in specs.items():
        n = math.prod(spec.shape)
        size = n * (4 if spec.dtype == torch.float32 else weight_bytes)
        if name == "model.embed_tokens.weight":
            continue
        if ".experts." in name:
            if ".experts.0." in name:
                expert_one += _expert_bytes(name, spec, weight_bytes, packed_experts)  # expert 0, every layer
            continue
        dense += size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    # expert_one summed the three matrices of expert 0 over every MoE layer: per-layer expert bytes
    per_expert = expert_one // max(moe_layers, 1)
    touched = (expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, batch)
               if distinct_experts is None else distinct_experts)
    experts = int(per_expert * touched * moe_layers)
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.full_attn_layers)
    state = cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4 * 2  # fp32 read + write
    conv = 3 * cfg.kda_dim * (cfg.conv_kernel_size - 1) * weight_bytes * 2
    kda = n_kda * batch * (state + conv)
    mla = n_mla * batch * context * cfg.mla_cache_width * weight_bytes
    emb = batch * cfg.hidden_size * weight_bytes
    return FloorBytes(dense, experts, kda, mla, emb)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    return nbytes / times[len(times) // 2]
