"""How a checkpoint's config.json becomes the fields of a ModelConfig (k3verify/config.py): the only code that knows
config.json field names. It is strict: unknown keys raise at every level, missing keys raise (no silent defaults
for ids, expert counts or layer lists), 1-based layer lists are converted to 0-based once, and the KDA /
full-attention lists must partition the layers. The keys transformers re-saves are accepted only where they agree
with the rest (check_transformers_echoes, run on the built config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Keys a released Kimi-K3 config.json carries at its top level.
K3_TOP_KEYS = frozenset({
    "model_type", "architectures", "auto_map", "text_config", "vision_config", "bos_token_id",
    "eos_token_id", "pad_token_id", "media_placeholder_token_id", "image_placeholder", "ignore_index",
    "dtype", "tie_word_embeddings", "transformers_version",
})

# Keys shared by K3's text_config and Kimi-Linear's flat config.
_COMMON_TEXT_KEYS = frozenset({
    "model_type", "architectures", "auto_map", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "intermediate_size", "hidden_act", "initializer_range", "rms_norm_eps",
    "max_position_embeddings", "linear_attn_config", "first_k_dense_replace", "moe_intermediate_size",
    "moe_layer_freq", "num_experts", "n_routed_experts", "num_experts_per_token", "num_shared_experts",
    "num_expert_group", "topk_group", "topk_method", "use_grouped_topk", "moe_renormalize",
    "moe_router_activation_func", "routed_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
    "torch_dtype", "tie_word_embeddings", "use_cache", "num_nextn_predict_layers", "transformers_version",
})

K3_TEXT_KEYS = _COMMON_TEXT_KEYS | frozenset({
    "activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size", "routed_expert_hidden_size",
    "latent_moe_use_norm", "mla_use_output_gate", "quantization_config",
})

# Kimi-Linear's published config plus what transformers' save_pretrained adds.
KIMI_LINEAR_KEYS = _COMMON_TEXT_KEYS | frozenset({
    "head_dim", "model_max_length", "rope_scaling", "rope_theta",
    # written by transformers' KimiLinearConfig.save_pretrained
    "layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
    # transformers 5 renamed rope_scaling -> rope_parameters and writes it (null here: MLA uses no rotary)
    "rope_parameters",
    "n_shared_experts", "num_local_experts", "num_experts_per_tok", "n_group", "norm_topk_prob",
    "output_router_logits", "pretraining_tp", "attention_bias", "attention_dropout", "qk_head_dim",
})

LINEAR_ATTN_KEYS = frozenset({
    "num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers", "gate_lower_bound",
    "use_full_rank_gate",
})

QUANT_KEYS = frozenset({"quant_method", "format", "config_groups", "ignore", "quantization_status",
                        "kv_cache_scheme", "global_compression_ratio", "sparsity_config"})
QUANT_GROUP_KEYS = frozenset({"format", "targets", "weights", "input_activations", "output_activations"})
QUANT_WEIGHT_KEYS = frozenset({"num_bits", "type", "strategy", "symmetric", "group_size", "dynamic",
                               "observer", "observer_kwargs", "actorder", "block_structure", "scale_dtype",
                               "zp_dtype"})

VISION_KEYS = frozenset({
    "_attn_implementation", "patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
    "pos_emb_type", "vt_num_attention_heads", "vt_num_hidden_layers", "vt_hidden_size", "vt_intermediate_size",
    "qkv_hidden_size", "merge_kernel_size", "merge_type", "mm_projector_type", "mm_hidden_size",
    "projector_hidden_act", "projector_ln_eps", "text_hidden_size", "norm_type", "mlp_type", "activation_func",
    "pos_emb_interpolation_mode", "attn_bias", "patch_embed_proj_bias", "linear_bias", "model_type",
})

# Generic keys transformers' PreTrainedConfig.to_dict() may add on re-save; accepted, never used.
_TRANSFORMERS_GENERIC_KEYS = frozenset({
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task", "cross_attention_hidden_size",
    "add_cross_attention", "tf_legacy_loss", "use_bfloat16", "pruned_heads", "torchscript", "is_decoder",
})


class ConfigError(ValueError):
    """A config.json that this project refuses to guess about."""


@dataclass(frozen=True)
class QuantConfig:
    """Compressed-tensors MXFP4 for routed experts: E2M1 codes + one E8M0 scale per `group_size` inputs."""

    format: str
    group_size: int
    ignore: tuple[str, ...]



class Shape(Protocol):
    """What the echo check reads of a built config (a ModelConfig)."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def kda_head_dim(self) -> int: ...
    @property
    def kda_num_heads(self) -> int: ...
    @property
    def conv_kernel_size(self) -> int: ...
    @property
    def qk_head_dim(self) -> int: ...
    def is_moe_layer(self, layer: int) -> bool: ...
    def layer_kind(self, layer: int) -> str: ...


@dataclass(frozen=True)
class Parsed:
    """A config.json read: the ModelConfig's fields, and the text config with its name for the echo check."""

    fields: dict[str, Any]
    text: dict[str, Any]
    where: str


def read_file(path: str | Path) -> tuple[bytes, bytes | None, Path]:
    """config.json's bytes (path: the file or its folder), generation_config.json's beside it if any, the path."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json not found: {path}")
    gen = path.parent / "generation_config.json"
    return path.read_bytes(), gen.read_bytes() if gen.is_file() else None, path


def parse_bytes(config: bytes | bytearray, generation: bytes | bytearray | None,
                path: str | Path = "config.json") -> Parsed:
    """From the bytes of config.json and (if the checkpoint has one) generation_config.json; `path` names
    config.json in errors."""
    try:
        data = json.loads(config)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object; got {type(data).__name__}")
    gen_path = Path(path).parent / "generation_config.json"
    gen_eos = () if generation is None else _generation_eos(generation, gen_path)
    return parse_hf_dict(data, generation_eos=gen_eos)


def parse_hf_dict(data: dict[str, Any], *, generation_eos: tuple[int, ...] = ()) -> Parsed:
    """Parse a checkpoint's config.json dict (kimi_k3 with nested text_config, or flat kimi_linear)."""
    model_type = data.get("model_type")
    if model_type == "kimi_k3":
        _check_keys(data, K3_TOP_KEYS, "config.json")
        text = _require(data, "text_config", "config.json")
        if not isinstance(text, dict):
            raise ConfigError(f"config.json: text_config must be an object, got {type(text).__name__}")
        _check_keys(text, K3_TEXT_KEYS | _TRANSFORMERS_GENERIC_KEYS, "text_config")
        if text.get("model_type") not in (None, "kimi_linear"):
            raise ConfigError(f"text_config.model_type must be 'kimi_linear'; got {text.get('model_type')!r}")
        vision = data.get("vision_config")
        if vision is not None:
            _check_keys(vision, VISION_KEYS, "vision_config")
        top_pad, text_pad = data.get("pad_token_id"), text.get("pad_token_id")
        if "pad_token_id" in data and "pad_token_id" in text and top_pad != text_pad:
            raise ConfigError(f"pad_token_id differs: top level {top_pad} vs text_config {text_pad}")
        for key in ("bos_token_id", "eos_token_id"):
            if key in data and key in text and data[key] != text[key]:
                raise ConfigError(f"{key} differs: top level {data[key]!r} vs text_config {text[key]!r}")
        fields = _parse_text(text, is_k3=True, generation_eos=generation_eos)
        media = _require(data, "media_placeholder_token_id", "config.json")
        fields.update(media_placeholder_token_id=int(media), checkpoint_prefix="language_model.")
        return Parsed(fields, text, "text_config")
    if model_type == "kimi_linear":
        _check_keys(data, KIMI_LINEAR_KEYS | _TRANSFORMERS_GENERIC_KEYS, "config.json")
        return Parsed(_parse_text(data, is_k3=False, generation_eos=generation_eos), data, "config.json")
    raise ConfigError(f"model_type must be 'kimi_k3' or 'kimi_linear'; got {model_type!r}")


def _check_keys(d: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; refusing to guess what they mean")


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing required key {key!r}")
    return d[key]


def _generation_eos(raw: bytes | bytearray, path: Path) -> tuple[int, ...]:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object; got {type(data).__name__}")
    eos = data.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _parse_layer_lists(lin: dict[str, Any], n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    kda_1 = _require(lin, "kda_layers", "linear_attn_config")
    full_1 = _require(lin, "full_attn_layers", "linear_attn_config")
    for name, lst in (("kda_layers", kda_1), ("full_attn_layers", full_1)):
        if not isinstance(lst, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in lst):
            raise ConfigError(f"linear_attn_config.{name} must be a list of 1-based ints; got {lst!r}")
    kda = tuple(i - 1 for i in kda_1)
    full = tuple(i - 1 for i in full_1)
    union = sorted(kda + full)
    if union != list(range(n)):
        raise ConfigError(
            f"kda_layers and full_attn_layers (1-based) must partition 1..{n}; got kda_layers={kda_1} "
            f"and full_attn_layers={full_1}"
        )
    return tuple(sorted(kda)), tuple(sorted(full))


def _parse_quant(q: dict[str, Any]) -> QuantConfig:
    _check_keys(q, QUANT_KEYS, "quantization_config")
    method = _require(q, "quant_method", "quantization_config")
    fmt = _require(q, "format", "quantization_config")
    if method != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ConfigError(f"only compressed-tensors mxfp4-pack-quantized is supported; got {method!r} / {fmt!r}")
    groups = _require(q, "config_groups", "quantization_config")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("quantization_config.config_groups must be a non-empty object")
    sizes = set()
    for name, group in groups.items():
        _check_keys(group, QUANT_GROUP_KEYS, f"quantization_config.config_groups.{name}")
        weights = _require(group, "weights", f"config_groups.{name}")
        _check_keys(weights, QUANT_WEIGHT_KEYS, f"quantization_config.config_groups.{name}.weights")
        bits = _require(weights, "num_bits", f"config_groups.{name}.weights")
        if bits != 4:
            raise ConfigError(f"config_groups.{name}.weights.num_bits must be 4 for mxfp4; got {bits}")
        sizes.add(int(_require(weights, "group_size", f"config_groups.{name}.weights")))
    if len(sizes) != 1:
        raise ConfigError(f"all mxfp4 config groups must share one group_size; got {sorted(sizes)}")
    return QuantConfig(format=fmt, group_size=sizes.pop(), ignore=tuple(q.get("ignore", ())))


def _first(d: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    present = [k for k in keys if k in d]
    if not present:
        raise ConfigError(f"{where}: missing required key {keys[0]!r} (also accepted: {list(keys[1:])})")
    values = {json.dumps(d[k]) for k in present}
    if len(values) > 1:
        raise ConfigError(f"{where}: {present} disagree: {[d[k] for k in present]}")
    return d[present[0]]


def _parse_text(t: dict[str, Any], *, is_k3: bool, generation_eos: tuple[int, ...]) -> dict[str, Any]:
    where = "text_config" if is_k3 else "config.json"
    if t.get("num_nextn_predict_layers"):
        raise NotImplementedError(
            f"num_nextn_predict_layers={t['num_nextn_predict_layers']}: multi-token prediction layers are not supported"
        )
    n = int(_require(t, "num_hidden_layers", where))
    lin = _require(t, "linear_attn_config", where)
    if not isinstance(lin, dict):
        raise ConfigError(f"{where}.linear_attn_config must be an object")
    _check_keys(lin, LINEAR_ATTN_KEYS, f"{where}.linear_attn_config")
    kda, full = _parse_layer_lists(lin, n)
    heads = int(_require(t, "num_attention_heads", where))
    kv_heads = t.get("num_key_value_heads", heads)
    if kv_heads not in (None, heads):
        raise ConfigError(f"num_key_value_heads must equal num_attention_heads ({heads}) for MLA; got {kv_heads}")
    act = _require(t, "hidden_act", where)
    if act not in ("silu", "situ"):
        raise ConfigError(f"hidden_act must be 'silu' or 'situ'; got {act!r}")
    situ_beta = situ_lin = None
    if act == "situ":
        situ_beta = float(_require(t, "activation_situ_beta", where))
        situ_lin = t.get("activation_situ_linear_beta")
        situ_lin = None if situ_lin is None else float(situ_lin)
    router_act = _require(t, "moe_router_activation_func", where)
    if router_act != "sigmoid":
        raise ConfigError(f"moe_router_activation_func must be 'sigmoid'; got {router_act!r}")
    groups = int(t.get("num_expert_group", 1) or 1)
    topk_group = int(t.get("topk_group", 1) or 1)
    num_experts = int(_first(t, ("num_experts", "n_routed_experts", "num_local_experts"), where))
    top_k = int(_first(t, ("num_experts_per_token", "num_experts_per_tok"), where))
    shared = int(_first(t, ("num_shared_experts", "n_shared_experts"), where))
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_token={top_k} exceeds num_experts={num_experts}")
    if num_experts % groups:
        raise ConfigError(f"num_experts={num_experts} is not divisible by num_expert_group={groups}")
    eos = _require(t, "eos_token_id", where)
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
    eos_ids = eos_ids + tuple(e for e in generation_eos if e not in eos_ids)
    quant = t.get("quantization_config")
    lower = lin.get("gate_lower_bound")
    return dict(
        model_type="kimi_k3" if is_k3 else "kimi_linear",
        vocab_size=int(_require(t, "vocab_size", where)),
        hidden_size=int(_require(t, "hidden_size", where)),
        num_hidden_layers=n,
        rms_norm_eps=float(_require(t, "rms_norm_eps", where)),
        num_attention_heads=heads,
        q_lora_rank=t.get("q_lora_rank"),
        kv_lora_rank=int(_require(t, "kv_lora_rank", where)),
        qk_nope_head_dim=int(_require(t, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(_require(t, "qk_rope_head_dim", where)),
        v_head_dim=int(_require(t, "v_head_dim", where)),
        mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
        kda_num_heads=int(_require(lin, "num_heads", f"{where}.linear_attn_config")),
        kda_head_dim=int(_require(lin, "head_dim", f"{where}.linear_attn_config")),
        conv_kernel_size=int(_require(lin, "short_conv_kernel_size", f"{where}.linear_attn_config")),
        kda_layers=kda,
        full_attn_layers=full,
        use_full_rank_gate=bool(lin.get("use_full_rank_gate", False)),
        gate_lower_bound=None if lower is None else float(lower),
        hidden_act=act,
        situ_beta=situ_beta,
        situ_linear_beta=situ_lin,
        intermediate_size=int(_require(t, "intermediate_size", where)),
        first_k_dense_replace=int(_require(t, "first_k_dense_replace", where)),
        moe_layer_freq=int(t.get("moe_layer_freq", 1)),
        moe_intermediate_size=int(_require(t, "moe_intermediate_size", where)),
        num_experts=num_experts,
        num_experts_per_token=top_k,
        num_shared_experts=shared,
        num_expert_group=groups,
        topk_group=topk_group,
        moe_renormalize=bool(_first(t, ("moe_renormalize", "norm_topk_prob"), where)),
        routed_scaling_factor=float(_require(t, "routed_scaling_factor", where)),
        routed_expert_hidden_size=t.get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(t.get("latent_moe_use_norm", False)),
        attn_res_block_size=t.get("attn_res_block_size"),
        bos_token_id=int(_require(t, "bos_token_id", where)),
        eos_token_ids=eos_ids,
        pad_token_id=t.get("pad_token_id"),
        max_position_embeddings=int(_first(t, ("max_position_embeddings", "model_max_length"), where)),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        quant=_parse_quant(quant) if quant is not None else None,
    )


def check_transformers_echoes(t: dict[str, Any], cfg: Shape, where: str) -> None:
    """Keys transformers re-saves restate facts parsed elsewhere; accepted only when they agree."""
    moe = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)]
    echoes = {
        "layer_types": [{"kda": "linear_attention", "mla": "full_attention"}[cfg.layer_kind(i)]
                        for i in range(cfg.num_hidden_layers)],
        "mlp_layer_types": moe,
        "linear_head_dim": cfg.kda_head_dim,
        "linear_num_heads": cfg.kda_num_heads,
        "linear_conv_kernel_dim": cfg.conv_kernel_size,
        "qk_head_dim": cfg.qk_head_dim,
    }
    for key, want in echoes.items():
        if key in t and t[key] != want:
            raise ConfigError(f"{where}: {key}={t[key]!r} contradicts the rest of the config, which implies {want!r}")
