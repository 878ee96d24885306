"""ModelConfig: the one frozen description of a Kimi-Linear / Kimi-K3 text model, and the facts derived from it.

`ModelConfig.from_hf_dict` (`from_file`, `from_bytes`) builds one from a checkpoint's config.json through
k3verify/config_json.py, the only code that knows config.json field names, then checks the invariants the fields
must hold together (`_validate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3verify.config_json import (
    ConfigError,
    Parsed,
    QuantConfig,
    check_transformers_echoes,
    parse_bytes,
    parse_hf_dict,
    read_file,
)

__all__ = ["ConfigError", "ModelConfig", "QuantConfig"]


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "kimi_linear" | "kimi_k3"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    kda_layers: tuple[int, ...]  # 0-based
    full_attn_layers: tuple[int, ...]  # 0-based
    use_full_rank_gate: bool
    gate_lower_bound: float | None  # None: plain softplus gate; else K3 "safe gate"
    # FFN / MoE
    hidden_act: str  # "silu" | "situ"
    situ_beta: float | None
    situ_linear_beta: float | None
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    routed_expert_hidden_size: int | None  # K3 LatentMoE latent width
    latent_moe_use_norm: bool
    # Block Attention Residuals
    attn_res_block_size: int | None
    # ids and misc
    bos_token_id: int
    eos_token_ids: tuple[int, ...]  # config/tokenizer eos first, then any other (generation_config) eos
    pad_token_id: int | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    media_placeholder_token_id: int | None = None
    quant: QuantConfig | None = None
    checkpoint_prefix: str = ""  # "language_model." for K3 checkpoints
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- derived facts (never written back) ----
    @property
    def is_k3(self) -> bool:
        return self.model_type == "kimi_k3"

    @property
    def has_kda(self) -> bool:
        return bool(self.kda_layers)

    @property
    def has_mla(self) -> bool:
        return bool(self.full_attn_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: [c_normed | k_rot]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def a_log_width(self) -> int:
        """Stored A_log length. K3 ships it padded to the next power of two (96 heads → 128)."""
        if not self.is_k3:
            return self.kda_num_heads
        return 1 << max(0, math.ceil(math.log2(self.kda_num_heads)))

    @property
    def uses_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_in_dim(self) -> int:
        """Width routed experts read and write: the latent for LatentMoE, else hidden."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def experts_quantized(self) -> bool:
        return self.quant is not None

    # Values that exist only for some configs: read through these, which name what is missing.
    @property
    def mxfp4_group_size(self) -> int:
        if self.quant is None:
            raise ValueError("this config's experts are not quantized: it has no MXFP4 group size")
        return self.quant.group_size

    @property
    def latent_size(self) -> int:
        if self.routed_expert_hidden_size is None:
            raise ValueError("this config has no LatentMoE (routed_expert_hidden_size is unset)")
        return self.routed_expert_hidden_size

    @property
    def residual_block_size(self) -> int:
        if self.attn_res_block_size is None:
            raise ValueError("this config has no Block Attention Residuals (attn_res_block_size is unset)")
        return self.attn_res_block_size

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def layer_kind(self, layer: int) -> str:
        """'kda' or 'mla' for a 0-based layer index."""
        return "kda" if layer in self.kda_layers else "mla"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and (layer - self.first_k_dense_replace) % self.moe_layer_freq == 0

    # ---- building ----
    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """From a checkpoint folder or its config.json (generation_config.json beside it read too)."""
        config, generation, where = read_file(path)
        return cls.from_bytes(config, generation, where)

    @classmethod
    def from_bytes(cls, config: bytes | bytearray, generation: bytes | bytearray | None,
                   path: str | Path = "config.json") -> ModelConfig:
        """From the bytes of config.json and (if the checkpoint has one) generation_config.json; `path` names
        config.json in errors. `serve` parses the very bytes its checkpoint digest covered."""
        return cls._built(parse_bytes(config, generation, path))

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], *, generation_eos: tuple[int, ...] = ()) -> ModelConfig:
        """Parse a checkpoint's config.json dict (kimi_k3 with nested text_config, or flat kimi_linear)."""
        return cls._built(parse_hf_dict(data, generation_eos=generation_eos))

    @classmethod
    def _built(cls, parsed: Parsed) -> ModelConfig:
        cfg = cls(**parsed.fields)
        _validate(cfg)
        check_transformers_echoes(parsed.text, cfg, parsed.where)
        return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.mla_use_output_gate and not cfg.is_k3:
        raise ConfigError("mla_use_output_gate is a kimi_k3 feature; kimi_linear configs must not set it")
    if cfg.attn_res_block_size is not None and cfg.attn_res_block_size < 1:
        raise ConfigError(f"attn_res_block_size must be >= 1; got {cfg.attn_res_block_size}")
    if cfg.gate_lower_bound is not None and cfg.gate_lower_bound >= 0:
        raise ConfigError(f"gate_lower_bound must be negative; got {cfg.gate_lower_bound}")
    if cfg.quant is not None and cfg.expert_in_dim % cfg.quant.group_size:
        raise ConfigError(f"expert input width {cfg.expert_in_dim} is not a multiple of mxfp4 group "
                          f"{cfg.quant.group_size}")
    if cfg.quant is not None and cfg.moe_intermediate_size % cfg.quant.group_size:
        raise ConfigError(f"moe_intermediate_size {cfg.moe_intermediate_size} is not a multiple of mxfp4 group "
                          f"{cfg.quant.group_size}")
    if cfg.tie_word_embeddings:
        raise ConfigError("tie_word_embeddings=true is not supported by this family (lm_head is separate)")
    if cfg.latent_moe_use_norm and cfg.routed_expert_hidden_size is None:
        raise ConfigError("latent_moe_use_norm needs routed_expert_hidden_size")
