"""ModelConfig.from_hf_dict refuses to guess: each rejection names the key or value, and every preset parses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from k3verify.config import ConfigError, ModelConfig
from k3verify.presets import PRESETS, SYN_EOS, SYN_IM_END, preset_generation_config, preset_hf_config

Edit = Callable[[dict[str, Any]], None]


def _k3(edit: Edit) -> dict[str, Any]:
    cfg = preset_hf_config("k3-tiny")
    edit(cfg)
    return cfg


def _kl(edit: Edit) -> dict[str, Any]:
    cfg = preset_hf_config("kl-tiny")
    edit(cfg)
    return cfg


def _set(path: str, value: Any) -> Edit:
    def edit(cfg: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = cfg
        for key in parents:
            node = node[key]
        node[leaf] = value
    return edit


def _delete(path: str) -> Edit:
    def edit(cfg: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = cfg
        for key in parents:
            node = node[key]
        del node[leaf]
    return edit


def _reject(cfg: dict[str, Any], *fragments: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict(cfg)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"


UNKNOWN_KEY_LEVELS = [
    ("k3 top level", _k3, "surprise", "config.json"),
    ("k3 text_config", _k3, "text_config.surprise", "text_config"),
    ("k3 linear_attn_config", _k3, "text_config.linear_attn_config.surprise", "linear_attn_config"),
    ("k3 quantization_config", _k3, "text_config.quantization_config.surprise", "quantization_config"),
    ("k3 config_groups weights", _k3, "text_config.quantization_config.config_groups.group_0.weights.surprise",
     "config_groups.group_0.weights"),
    ("k3 vision_config", _k3, "vision_config.surprise", "vision_config"),
    ("kimi_linear top level", _kl, "surprise", "config.json"),
    ("kimi_linear linear_attn_config", _kl, "linear_attn_config.surprise", "linear_attn_config"),
]


@pytest.mark.parametrize(("level", "build", "path", "where"), UNKNOWN_KEY_LEVELS,
                         ids=[u[0] for u in UNKNOWN_KEY_LEVELS])
def test_unknown_key_is_rejected_at_every_level(level: str, build: Callable[[Edit], dict[str, Any]], path: str,
                                                where: str) -> None:
    """An unknown key anywhere raises, naming the key and where it sits."""
    _reject(build(_set(path, 1)), "unknown key(s) ['surprise']", where)


def test_overlapping_layer_lists_are_rejected() -> None:
    """A layer listed as both KDA and MLA does not partition the layers."""
    _reject(_k3(_set("text_config.linear_attn_config.kda_layers", [1, 2, 3, 4, 5])), "must partition 1..6",
            "kda_layers=[1, 2, 3, 4, 5]")


def test_layer_lists_with_a_gap_are_rejected() -> None:
    """A layer in neither list (layer 5 here) is rejected."""
    _reject(_k3(_set("text_config.linear_attn_config.kda_layers", [1, 2, 4])), "must partition 1..6",
            "full_attn_layers=[3, 6]")


def test_empty_layer_list_that_leaves_a_gap_is_rejected() -> None:
    """An empty KDA list is still checked: [] + [3, 6] does not cover 6 layers."""
    _reject(_k3(_set("text_config.linear_attn_config.kda_layers", [])), "must partition 1..6", "kda_layers=[]")


def test_empty_layer_list_that_partitions_is_accepted() -> None:
    """An all-KDA model (empty MLA list) parses and has no MLA layers."""
    cfg = _k3(_set("text_config.linear_attn_config.kda_layers", [1, 2, 3, 4, 5, 6]))
    _set("text_config.linear_attn_config.full_attn_layers", [])(cfg)
    parsed = ModelConfig.from_hf_dict(cfg)
    assert parsed.full_attn_layers == () and not parsed.has_mla


def test_layer_index_out_of_range_is_rejected() -> None:
    """1-based lists: a 0 (a 0-based list passed by mistake) cannot partition 1..n."""
    _reject(_kl(_set("linear_attn_config.kda_layers", [0, 1, 2, 4])), "must partition 1..5")


def test_mtp_layers_raise_not_implemented() -> None:
    """num_nextn_predict_layers > 0 is an unsupported feature, not a config error to shrug off."""
    with pytest.raises(NotImplementedError, match="num_nextn_predict_layers=1"):
        ModelConfig.from_hf_dict(_k3(_set("text_config.num_nextn_predict_layers", 1)))
    assert ModelConfig.from_hf_dict(_k3(_set("text_config.num_nextn_predict_layers", 0))).num_hidden_layers == 6


def test_missing_expert_count_is_rejected() -> None:
    """No silent default for the expert count."""
    _reject(_k3(_delete("text_config.num_experts")), "missing required key 'num_experts'", "n_routed_experts")


def test_pad_token_mismatch_between_top_level_and_text_config_is_rejected() -> None:
    _reject(_k3(_set("pad_token_id", 7)), "pad_token_id differs", "top level 7")


def test_unknown_model_type_is_rejected() -> None:
    _reject(_k3(_set("model_type", "kimi_k2")), "'kimi_k2'")


def test_unknown_hidden_act_is_rejected() -> None:
    _reject(_k3(_set("text_config.hidden_act", "gelu")), "hidden_act", "'gelu'")


def test_missing_media_placeholder_is_rejected() -> None:
    """Ids come from the config, never from constants."""
    _reject(_k3(_delete("media_placeholder_token_id")), "media_placeholder_token_id")


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_parses(name: str) -> None:
    cfg = ModelConfig.from_hf_dict(preset_hf_config(name))
    assert len(cfg.kda_layers) + len(cfg.full_attn_layers) == cfg.num_hidden_layers


def test_layer_lists_are_converted_from_one_based_once() -> None:
    cfg = ModelConfig.from_hf_dict(preset_hf_config("k3-tiny"))  # kda [1, 2, 4, 5], full [3, 6]
    assert cfg.kda_layers == (0, 1, 3, 4)
    assert cfg.full_attn_layers == (2, 5)
    assert [cfg.layer_kind(i) for i in range(6)] == ["kda", "kda", "mla", "kda", "kda", "mla"]


def test_both_eos_ids_are_kept() -> None:
    """config.json's [EOS] comes first, generation_config's <|im_end|> is kept as well."""
    gen = preset_generation_config("k3-tiny")
    cfg = ModelConfig.from_hf_dict(preset_hf_config("k3-tiny"), generation_eos=(gen["eos_token_id"],))
    assert cfg.eos_token_ids == (SYN_EOS, SYN_IM_END)
    assert cfg.eos_token_id == SYN_EOS


def test_both_eos_ids_are_kept_from_files(tmp_path: Any) -> None:
    """from_file reads generation_config.json next to config.json."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(preset_hf_config("kl-tiny")))
    (tmp_path / "generation_config.json").write_text(json.dumps(preset_generation_config("kl-tiny")))
    assert ModelConfig.from_file(tmp_path).eos_token_ids == (SYN_EOS, SYN_IM_END)


def test_num_experts_and_n_routed_experts_are_both_accepted() -> None:
    both = _k3(_set("text_config.n_routed_experts", 8))
    assert ModelConfig.from_hf_dict(both).num_experts == 8
    only_n_routed = _k3(_delete("text_config.num_experts"))
    _set("text_config.n_routed_experts", 8)(only_n_routed)
    assert ModelConfig.from_hf_dict(only_n_routed).num_experts == 8


def test_disagreeing_expert_counts_are_rejected() -> None:
    _reject(_k3(_set("text_config.n_routed_experts", 16)), "['num_experts', 'n_routed_experts'] disagree", "16")


def test_transformers_layer_types_must_agree_with_linear_attn_config() -> None:
    """A re-saved config's layer_types restates the layer lists; a contradiction is rejected, agreement accepted."""
    agree = ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    assert ModelConfig.from_hf_dict(_kl(_set("layer_types", agree))).full_attn_layers == (3,)
    _reject(_kl(_set("layer_types", ["linear_attention"] * 5)), "layer_types=", "contradicts")


def test_transformers_mlp_layer_types_must_agree_with_first_k_dense_replace() -> None:
    _reject(_kl(_set("mlp_layer_types", ["sparse"] * 5)), "mlp_layer_types=", "'dense'")
