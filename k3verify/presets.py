"""Named model shapes, written as the config.json a checkpoint would carry.

Synthetic presets (small enough for CPU) go through the same strict parser as real checkpoints:
- k3-tiny     every K3 feature at toy width; the default for `k3verify parity`.
- k3-syn-25   25 layers in the real 3:1 KDA/MLA rhythm with a ragged last residual block, 64 experts top-16.
- k3-skew-10  every pair of dims that production ties together is decoupled (latent != hidden/2,
              v_head != qk_nope, KDA head dim != MLA dims, rms eps 2e-5, grouped top-k), odd widths.
- kl-tiny     Kimi-Linear features only (transformers' KimiLinear can run it).
- kl-256      kl-tiny with every row a k-quant can take a multiple of 256 (hidden, FFN and expert widths, the MLA
              latent, the KDA width): llama-quantize writes such rows as Q4_K/Q5_K/Q6_K, where it falls back to
              Q5_0/Q8_0 on the 32-96-wide presets. Rows it cannot (the KDA gate LoRA's 64, MLA's k_b of 32) stay so.
- k3-tp4      k3-tiny with every count a parallel layout splits (KDA and MLA heads, experts, vocab, FFN and
              latent widths) divisible by 2 and 4, so tensor/expert parallel worlds of 2 and 4 split evenly.
Real shapes (`k3`, `kimi-linear-48b`) are for meta-device builds, planning and reconciling only.
"""

from __future__ import annotations

import copy
from typing import Any

from k3verify.config import ModelConfig

# Ids of the project's own tokenizer (k3verify/tokenizer/assets): N base tokens, then 258 specials.
TOKENIZER_BASE_VOCAB = 4096
SYN_VOCAB = TOKENIZER_BASE_VOCAB + 512
SYN_BOS, SYN_EOS, SYN_IM_END = TOKENIZER_BASE_VOCAB, TOKENIZER_BASE_VOCAB + 1, TOKENIZER_BASE_VOCAB + 2
SYN_PAD = TOKENIZER_BASE_VOCAB + 255  # [PAD] in the shipped tokenizer_config.json
SYN_MEDIA = TOKENIZER_BASE_VOCAB + 21


def _rhythm(n: int, every: int = 4, last_full: bool = False) -> tuple[list[int], list[int]]:
    """1-based (kda, full) lists: every `every`-th layer is MLA, optionally the last one too."""
    full = [i for i in range(1, n + 1) if i % every == 0]
    if last_full and n not in full:
        full.append(n)
    kda = [i for i in range(1, n + 1) if i not in full]
    return kda, full


def _mxfp4_quant(group_size: int = 32) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "symmetric": True,
                            "group_size": group_size},
            }
        },
        "ignore": [r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\..*", "lm_head",
                   r"re:.*routed_expert_(down|up)_proj.*", r"re:.*gate$"],
        "quantization_status": "compressed",
    }


def _with_overrides(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `over`; a `linear_attn_config` override merges into the base's rather than replacing it."""
    lin_over = over.pop("linear_attn_config", {})
    base.update(over)
    base["linear_attn_config"] = {**base["linear_attn_config"], **lin_over}
    return base


def _k3_text(**over: Any) -> dict[str, Any]:
    text: dict[str, Any] = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": SYN_VOCAB,
        "intermediate_size": 192,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "attn_res_block_size": 2,
        "linear_attn_config": {
            "num_heads": 3, "head_dim": 16, "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6],
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
        },
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 64,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_grouped_topk": False,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "routed_expert_hidden_size": 64,
        "latent_moe_use_norm": True,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "quantization_config": _mxfp4_quant(),
        "bos_token_id": SYN_BOS,
        "eos_token_id": SYN_EOS,
        "pad_token_id": SYN_PAD,
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    return _with_overrides(text, over)


def _k3(text: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"patch_size": 14, "vt_hidden_size": 32, "vt_num_hidden_layers": 1,
                          "vt_num_attention_heads": 2, "vt_intermediate_size": 64, "merge_kernel_size": [2, 2],
                          "mm_hidden_size": 32, "text_hidden_size": text["hidden_size"]},
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "media_placeholder_token_id": SYN_MEDIA,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "ignore_index": -100,
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def _kimi_linear(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 72,
        "vocab_size": SYN_VOCAB,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "model_max_length": 4096,
        "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]},
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "use_grouped_topk": False,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "bos_token_id": SYN_BOS,
        "eos_token_id": SYN_EOS,
        "pad_token_id": SYN_PAD,
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    return _with_overrides(cfg, over)


# The widths kl-256 sets on kl-tiny (a checkpoint of other ids, e.g. its own tokenizer's, takes these as overrides).
KL_256: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256, "kv_lora_rank": 256,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64, "num_experts": 8, "num_experts_per_token": 2,
    "linear_attn_config": {"num_heads": 4, "head_dim": 64},
}


def _kl_256() -> dict[str, Any]:
    return _kimi_linear(**copy.deepcopy(KL_256))


def _syn25() -> dict[str, Any]:
    kda, full = _rhythm(25)
    return _k3(_k3_text(
        hidden_size=64, num_hidden_layers=25, intermediate_size=128, attn_res_block_size=6,
        num_experts=64, num_experts_per_token=16, moe_intermediate_size=32, routed_expert_hidden_size=32,
        q_lora_rank=32, kv_lora_rank=32,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "kda_layers": kda, "full_attn_layers": full},
    ))


def _skew10() -> dict[str, Any]:
    return _k3(_k3_text(
        hidden_size=72, num_hidden_layers=10, num_attention_heads=5, num_key_value_heads=5, intermediate_size=136,
        rms_norm_eps=2e-5, attn_res_block_size=3, q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=6, v_head_dim=10, moe_intermediate_size=64, routed_expert_hidden_size=96,
        num_experts=12, num_experts_per_token=3, num_shared_experts=2, num_expert_group=3, topk_group=2,
        use_grouped_topk=True, routed_scaling_factor=1.7,
        linear_attn_config={"num_heads": 3, "head_dim": 20, "short_conv_kernel_size": 3,
                            "kda_layers": [1, 2, 4, 5, 6, 8, 9], "full_attn_layers": [3, 7, 10]},
    ))


def _k3_real() -> dict[str, Any]:
    kda, full = _rhythm(93, last_full=True)
    text = _k3_text(
        hidden_size=7168, num_hidden_layers=93, num_attention_heads=96, num_key_value_heads=96,
        vocab_size=163840, intermediate_size=33792, attn_res_block_size=12, max_position_embeddings=262144,
        num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
        linear_attn_config={"num_heads": 96, "head_dim": 128, "kda_layers": kda, "full_attn_layers": full},
    )
    cfg = _k3(text)
    cfg["media_placeholder_token_id"] = 163605
    return cfg


def _kimi_linear_48b() -> dict[str, Any]:
    kda, full = _rhythm(27, last_full=True)
    return _kimi_linear(
        hidden_size=2304, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32, head_dim=192,
        vocab_size=163840, intermediate_size=9216, moe_intermediate_size=1024, num_experts=256,
        num_experts_per_token=8, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        model_max_length=1048576, bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
        linear_attn_config={"num_heads": 32, "head_dim": 128, "kda_layers": kda, "full_attn_layers": full},
    )


def _kl_48b_8l() -> dict[str, Any]:
    """Kimi-Linear widths cut to 8 layers: the GPU baseline shape of GPU.md (13.85 B parameters)."""
    cfg = _kimi_linear_48b()
    cfg["num_hidden_layers"] = 8
    cfg["linear_attn_config"] = {**cfg["linear_attn_config"], "kda_layers": [1, 2, 3, 5, 6, 7],
                                 "full_attn_layers": [4, 8]}
    return cfg


def _k3_slice_4l() -> dict[str, Any]:
    """K3 widths (hidden 7168, 96 KDA and MLA heads, LatentMoE 3584, MXFP4) cut to 4 layers and 64 experts:
    a K3-shaped slice that fits one H200 (~12 GB)."""
    cfg = _k3_real()
    text = cfg["text_config"]
    text.update(num_hidden_layers=4, num_experts=64, attn_res_block_size=2)
    text["linear_attn_config"] = {**text["linear_attn_config"], "kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    return cfg


def _tp4() -> dict[str, Any]:
    return _k3(_k3_text(linear_attn_config={"num_heads": 4}))


_BUILDERS = {
    "k3-tiny": lambda: _k3(_k3_text()),
    "k3-tp4": _tp4,
    "k3-syn-25": _syn25,
    "k3-skew-10": _skew10,
    "kl-tiny": _kimi_linear,
    "kl-256": _kl_256,
    "k3": _k3_real,
    "kimi-linear-48b": _kimi_linear_48b,
    "kl-48b-8l": _kl_48b_8l,
    "k3-slice-4l": _k3_slice_4l,
}

SYNTHETIC_PRESETS = ("k3-tiny", "k3-syn-25", "k3-skew-10", "kl-tiny", "kl-256", "k3-tp4")
PRESETS = tuple(_BUILDERS)


def preset_hf_config(name: str) -> dict[str, Any]:
    """The config.json dict of a preset (a fresh copy)."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return copy.deepcopy(_BUILDERS[name]())


def preset_generation_config(name: str) -> dict[str, Any]:
    """generation_config.json: eos is <|im_end|>, unlike config.json's [EOS] (both must be honoured)."""
    hf = preset_hf_config(name)
    text = hf.get("text_config", hf)
    im_end = text["bos_token_id"] + 2
    return {"bos_token_id": text["bos_token_id"], "eos_token_id": im_end, "pad_token_id": text["pad_token_id"],
            "max_new_tokens": 256}


def get_preset(name: str) -> ModelConfig:
    gen = preset_generation_config(name)
    return ModelConfig.from_hf_dict(preset_hf_config(name), generation_eos=(gen["eos_token_id"],))
