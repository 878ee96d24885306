"""The one name map between checkpoint tensors and module parameters.

Module attribute paths equal checkpoint keys (less K3's `language_model.` prefix), so loading is a
short loop. Two places differ on purpose and are spelled out here:
- MXFP4 routed experts are stored as `wN.weight_packed` + `wN.weight_scale`; a module that holds
  dense experts (the oracle) owns `wN.weight` and is filled by dequantizing the pair.
- K3 stores `A_log` wider than the head count; modules allocate the stored width and use [:heads].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3verify.config import ModelConfig

# Checkpoint tensors with no destination in a text-only model, each with the reason it may be ignored.
IGNORABLE: tuple[tuple[str, str], ...] = (
    (r"^vision_tower\.", "vision encoder: text-only serving does not run it"),
    (r"^mm_projector\.", "multimodal projector: text-only serving does not run it"),
)

_QUANT_SUFFIX = re.compile(r"^(.*\.experts\.\d+\.w[123])\.(weight_packed|weight_scale)$")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str  # drives the synthetic distribution: norm, linear, embed, a_log, dt_bias, conv, ...


_IGNORABLE_COMPILED = tuple((re.compile(pattern), reason) for pattern, reason in IGNORABLE)


def ignorable_reason(ckpt_name: str) -> str | None:
    for pattern, reason in _IGNORABLE_COMPILED:  # precompiled: a K3 checkpoint has ~500k names
        if pattern.search(ckpt_name):
            return reason
    return None


def _kda_specs(cfg: ModelConfig, p: str, conv_dtype: torch.dtype) -> dict[str, TensorSpec]:
    H, D, dk, W = cfg.hidden_size, cfg.kda_dim, cfg.kda_head_dim, cfg.conv_kernel_size
    bf = torch.bfloat16
    dt_role = "dt_bias_safe" if cfg.gate_lower_bound is not None else "dt_bias"
    specs = {
        f"{p}q_proj.weight": TensorSpec((D, H), bf, "linear"),
        f"{p}k_proj.weight": TensorSpec((D, H), bf, "linear"),
        f"{p}v_proj.weight": TensorSpec((D, H), bf, "linear"),
        f"{p}q_conv1d.weight": TensorSpec((D, 1, W), conv_dtype, "conv"),
        f"{p}k_conv1d.weight": TensorSpec((D, 1, W), conv_dtype, "conv"),
        f"{p}v_conv1d.weight": TensorSpec((D, 1, W), conv_dtype, "conv"),
        f"{p}A_log": TensorSpec((cfg.a_log_width,) if cfg.is_k3 else (1, 1, cfg.kda_num_heads, 1), torch.float32,
                                "a_log"),
        f"{p}f_a_proj.weight": TensorSpec((dk, H), bf, "linear"),
        f"{p}f_b_proj.weight": TensorSpec((D, dk), bf, "linear"),
        f"{p}dt_bias": TensorSpec((D,), torch.float32, dt_role),
        f"{p}b_proj.weight": TensorSpec((cfg.kda_num_heads, H), bf, "linear"),
        f"{p}o_norm.weight": TensorSpec((dk,), bf, "norm"),
        f"{p}o_proj.weight": TensorSpec((H, D), bf, "linear"),
    }
    if cfg.use_full_rank_gate:
        specs[f"{p}g_proj.weight"] = TensorSpec((D, H), bf, "linear")
    else:
        specs[f"{p}g_a_proj.weight"] = TensorSpec((dk, H), bf, "linear")
        specs[f"{p}g_b_proj.weight"] = TensorSpec((D, dk), bf, "linear")
    return specs


def _mla_specs(cfg: ModelConfig, p: str) -> dict[str, TensorSpec]:
    H, nh, bf = cfg.hidden_size, cfg.num_attention_heads, torch.bfloat16
    specs: dict[str, TensorSpec] = {}
    if cfg.q_lora_rank is None:
        specs[f"{p}q_proj.weight"] = TensorSpec((nh * cfg.qk_head_dim, H), bf, "linear")
    else:
        specs[f"{p}q_a_proj.weight"] = TensorSpec((cfg.q_lora_rank, H), bf, "lora_a")
        specs[f"{p}q_a_layernorm.weight"] = TensorSpec((cfg.q_lora_rank,), bf, "norm")
        specs[f"{p}q_b_proj.weight"] = TensorSpec((nh * cfg.qk_head_dim, cfg.q_lora_rank), bf, "linear")
    specs[f"{p}kv_a_proj_with_mqa.weight"] = TensorSpec((cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), bf, "kv_a")
    specs[f"{p}kv_a_layernorm.weight"] = TensorSpec((cfg.kv_lora_rank,), bf, "norm")
    specs[f"{p}kv_b_proj.weight"] = TensorSpec((nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                                               bf, "linear")
    specs[f"{p}o_proj.weight"] = TensorSpec((H, nh * cfg.v_head_dim), bf, "linear")
    if cfg.mla_use_output_gate:
        specs[f"{p}g_proj.weight"] = TensorSpec((nh * cfg.v_head_dim, H), bf, "linear")
    return specs


def _glu_specs(p: str, hidden: int, inter: int, act_role: str) -> dict[str, TensorSpec]:
    bf = torch.bfloat16
    return {
        f"{p}gate_proj.weight": TensorSpec((inter, hidden), bf, f"glu_gate_{act_role}"),
        f"{p}up_proj.weight": TensorSpec((inter, hidden), bf, f"glu_up_{act_role}"),
        f"{p}down_proj.weight": TensorSpec((hidden, inter), bf, "glu_down"),
    }


def _moe_specs(cfg: ModelConfig, p: str) -> dict[str, TensorSpec]:
    H, E, Ie, Din, bf = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim, torch.bfloat16
    act = cfg.hidden_act
    specs = {
        f"{p}gate.weight": TensorSpec((E, H), bf, "router"),
        f"{p}gate.e_score_correction_bias": TensorSpec((E,), torch.float32, "router_bias"),
    }
    for e in range(E):
        q = f"{p}experts.{e}."
        for w, shape, role in (("w1", (Ie, Din), f"glu_gate_{act}"), ("w3", (Ie, Din), f"glu_up_{act}"),
                               ("w2", (Din, Ie), "glu_down")):
            if cfg.experts_quantized:
                gs = cfg.mxfp4_group_size
                specs[f"{q}{w}.weight_packed"] = TensorSpec((shape[0], shape[1] // 2), torch.uint8, f"mxfp4:{role}")
                specs[f"{q}{w}.weight_scale"] = TensorSpec((shape[0], shape[1] // gs), torch.uint8, f"mxfp4:{role}")
            else:
                specs[f"{q}{w}.weight"] = TensorSpec(shape, bf, role)
    specs.update(_glu_specs(f"{p}shared_experts.", H, cfg.shared_intermediate_size, act))
    if cfg.uses_latent_moe:
        L = cfg.latent_size
        specs[f"{p}routed_expert_down_proj.weight"] = TensorSpec((L, H), bf, "linear")
        if cfg.latent_moe_use_norm:
            specs[f"{p}routed_expert_norm.weight"] = TensorSpec((L,), bf, "norm")
        specs[f"{p}routed_expert_up_proj.weight"] = TensorSpec((H, L), bf, "linear")
    return specs


def module_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Text-model tensors in checkpoint naming without the K3 prefix, in a stable order."""
    H, V, bf = cfg.hidden_size, cfg.vocab_size, torch.bfloat16
    conv_dtype = torch.float32 if cfg.is_k3 else bf
    specs: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec((V, H), bf, "embed")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        specs[f"{p}input_layernorm.weight"] = TensorSpec((H,), bf, "norm")
        specs[f"{p}post_attention_layernorm.weight"] = TensorSpec((H,), bf, "norm")
        if cfg.uses_attn_res:
            for pair in ("self_attention_res", "mlp_res"):
                specs[f"{p}{pair}_norm.weight"] = TensorSpec((H,), bf, "norm")
                specs[f"{p}{pair}_proj.weight"] = TensorSpec((1, H), bf, "res_proj")
        if cfg.layer_kind(i) == "kda":
            specs.update(_kda_specs(cfg, f"{p}self_attn.", conv_dtype))
        else:
            specs.update(_mla_specs(cfg, f"{p}self_attn."))
        if cfg.is_moe_layer(i):
            specs.update(_moe_specs(cfg, f"{p}block_sparse_moe."))
        else:
            specs.update(_glu_specs(f"{p}mlp.", H, cfg.intermediate_size, cfg.hidden_act))
    specs["model.norm.weight"] = TensorSpec((H,), bf, "norm")
    if cfg.uses_attn_res:
        specs["model.output_attn_res_norm.weight"] = TensorSpec((H,), bf, "norm")
        specs["model.output_attn_res_proj.weight"] = TensorSpec((1, H), bf, "res_proj")
    specs["lm_head.weight"] = TensorSpec((V, H), bf, "lm_head")
    return specs


def checkpoint_specs(cfg: ModelConfig, *, with_ignorable: bool = True) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of this config holds, under its checkpoint name."""
    specs = {cfg.checkpoint_prefix + k: v for k, v in module_specs(cfg).items()}
    if cfg.is_k3 and with_ignorable:
        specs["vision_tower.patch_embed.proj.weight"] = TensorSpec((32, 3, 14, 14), torch.bfloat16, "linear")
        specs["vision_tower.encoder.final_layernorm.weight"] = TensorSpec((32,), torch.bfloat16, "norm")
        specs["mm_projector.proj.0.weight"] = TensorSpec((cfg.hidden_size, 128), torch.bfloat16, "linear")
    return specs


def to_module_name(cfg: ModelConfig, ckpt_name: str) -> str | None:
    """Checkpoint name -> module parameter name; None for a declared-ignorable tensor.

    Raises KeyError for a name outside the prefix (never silently dropped)."""
    if ignorable_reason(ckpt_name) is not None:
        return None
    prefix = cfg.checkpoint_prefix
    if prefix:
        if not ckpt_name.startswith(prefix):
            raise KeyError(f"checkpoint tensor {ckpt_name!r} lacks the {prefix!r} prefix and is not ignorable")
        return ckpt_name[len(prefix):]
    return ckpt_name


def quantized_pair(module_name: str) -> tuple[str, str] | None:
    """For `...experts.{e}.wN.weight_packed|weight_scale` return (dense name `...wN.weight`, which part)."""
    m = _QUANT_SUFFIX.match(module_name)
    return (f"{m.group(1)}.weight", m.group(2)) if m else None
