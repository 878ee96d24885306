"""transformers' KimiLinear checkpoints (save_pretrained and raw state_dict) load through our reader and name map."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from k3verify.checkpoint.buckets import build_param_module, reconcile_checkpoint
from k3verify.checkpoint.hf_interop import HfNameError, normalize_hf_names
from k3verify.checkpoint.loader import load_into
from k3verify.checkpoint.names import module_specs
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.synthetic import make_synthetic_checkpoint
from k3verify.checkpoint.synthetic_weights import synthetic_tensors
from k3verify.config import ModelConfig
from k3verify.presets import get_preset, preset_hf_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that Triton is unavailable on CPU; we never run forward here
    transformers = pytest.importorskip("transformers")
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

CFG = get_preset("kl-tiny")
pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(KimiLinearConfig(**preset_hf_config("kl-tiny"))).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def saved_dir(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "saved"
    hf_model.save_pretrained(out, max_shard_size="300KB")  # several shards: the index path
    return out


def _theirs(state: dict[str, torch.Tensor], ours: str) -> torch.Tensor:
    """Our name -> the value in transformers' live (runtime-named) state_dict, written out by hand."""
    d, inter = CFG.kda_dim, CFG.moe_intermediate_size
    if m := re.fullmatch(r"(.*self_attn\.)([qkv])_conv1d\.weight", ours):
        i = "qkv".index(m.group(2))
        return state[f"{m.group(1)}conv1d.weight"][i * d:(i + 1) * d]
    if m := re.fullmatch(r"(.*self_attn\.)(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)", ours):
        return state[f"{m.group(1)}forget_gate.{m.group(2)}"]
    if m := re.fullmatch(r"(.*)block_sparse_moe\.experts\.(\d+)\.w([123])\.weight", ours):
        e, w = int(m.group(2)), m.group(3)
        if w == "2":
            return state[f"{m.group(1)}mlp.experts.down_proj"][e]
        rows = slice(0, inter) if w == "1" else slice(inter, 2 * inter)
        return state[f"{m.group(1)}mlp.experts.gate_up_proj"][e, rows]
    return state[ours.replace(".block_sparse_moe.", ".mlp.")]


def _load_ours(tensors: Any) -> dict[str, torch.Tensor]:
    module = build_param_module(module_specs(CFG), device="cpu")
    load_into(module, CFG, normalize_hf_names(CFG, tensors))
    return module.state_dict()


def test_save_pretrained_writes_published_names_except_the_dense_mlp(saved_dir: Path) -> None:
    """Pins what transformers 5.24 writes: conversions reverted, but the dense layer's mlp.* comes out renamed."""
    names = set(CheckpointReader(saved_dir))
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names
    assert {"model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log"} <= names
    assert not [n for n in names if "forget_gate" in n or n.endswith("self_attn.conv1d.weight") or ".mlp." in n]


def test_save_pretrained_config_parses_strictly_to_the_same_model(saved_dir: Path) -> None:
    """layer_types, mlp_layer_types, rope_parameters, linear_* … are accepted and agree with the rest."""
    parsed = ModelConfig.from_file(saved_dir)
    assert replace(parsed, eos_token_ids=CFG.eos_token_ids) == CFG


def test_reconcile_without_normalization_shows_only_the_dense_mlp_quirk(saved_dir: Path) -> None:
    result = reconcile_checkpoint(saved_dir, cfg=CFG)
    assert sorted(result.no_source) == [f"model.layers.0.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
    assert sorted(u.name for u in result.no_destination) == [
        f"model.layers.0.block_sparse_moe.{p}_proj.weight" for p in ("down", "gate", "up")]
    # transformers' .to(bf16) also casts our fp32 tensors: the biases are dtype mismatches (no rule narrows them);
    # A_log in bf16 is what transformers writes for a bf16 model: rule a_log_bf16, reported, not a mismatch
    assert {(m.kind, m.module_name.rsplit(".", 1)[-1]) for m in result.mismatched} == {
        ("dtype", "dt_bias"), ("dtype", "e_score_correction_bias")}
    assert {(t.rule, t.module_name.rsplit(".", 1)[-1]) for t in result.tolerated} == {("a_log_bf16", "A_log")}


def test_save_pretrained_checkpoint_loads_with_transformers_values(saved_dir: Path, hf_model: Any) -> None:
    theirs = hf_model.state_dict()
    ours = _load_ours(CheckpointReader(saved_dir))
    assert len(ours) == len(module_specs(CFG))
    for name, value in ours.items():
        expected = _theirs(theirs, name)
        assert torch.equal(value, expected.to(value.dtype)), name


def test_raw_state_dict_with_fused_tensors_is_split_back(hf_model: Any, saved_dir: Path, tmp_path: Path) -> None:
    """safetensors.save_file(model.state_dict()) writes runtime names (fused conv, merged experts)."""
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    raw = CheckpointReader(tmp_path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in raw and "model.layers.0.self_attn.conv1d.weight" in raw
    from_raw = _load_ours(raw)
    from_saved = _load_ours(CheckpointReader(saved_dir))
    assert from_raw.keys() == from_saved.keys()
    assert all(torch.equal(from_raw[k], from_saved[k]) for k in from_saved)


def test_our_synthetic_checkpoint_round_trips_through_transformers(tmp_path: Path) -> None:
    """Our kl-tiny -> transformers' from_pretrained (its own conversion) -> normalize -> our exact tensors."""
    make_synthetic_checkpoint("kl-tiny", tmp_path / "syn")
    loaded = KimiLinearForCausalLM.from_pretrained(tmp_path / "syn", dtype=torch.float32)
    back = normalize_hf_names(CFG, loaded.state_dict())
    truth = synthetic_tensors(CFG, seed=0)
    assert set(back) == set(truth)
    for name, value in truth.items():
        assert torch.equal(back[name].to(value.dtype), value), name


def test_unaccounted_names_raise_listing_them(hf_model: Any) -> None:
    state = dict(hf_model.state_dict())
    state["model.layers.0.self_attn.mystery.weight"] = torch.zeros(1)
    state["model.layers.1.block_sparse_moe.gate_proj.weight"] = torch.zeros(1)  # dense spelling on a MoE layer
    with pytest.raises(HfNameError) as info:
        normalize_hf_names(CFG, state)
    assert "2 tensor name(s) have no place" in str(info.value)
    assert "model.layers.0.self_attn.mystery.weight" in str(info.value)
    assert "model.layers.1.block_sparse_moe.gate_proj.weight" in str(info.value)


def test_two_sources_for_one_tensor_raise(hf_model: Any) -> None:
    state = dict(hf_model.state_dict())
    state["model.layers.0.self_attn.A_log"] = state["model.layers.0.self_attn.forget_gate.A_log"]
    with pytest.raises(HfNameError, match=r"1 collision\(s\).*model\.layers\.0\.self_attn\.A_log"):
        normalize_hf_names(CFG, state)


def test_reconcile_hf_names_maps_a_save_pretrained_dir_clean(saved_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--hf-names: the dense-layer quirk is mapped, the rest stays strict; without it the CLI hints at the flag."""
    from k3verify.cli import main

    result = reconcile_checkpoint(saved_dir, cfg=CFG, hf_names=True)
    assert not (result.no_source or result.partial or result.no_destination)
    assert {m.module_name.rsplit(".", 1)[-1] for m in result.mismatched} == {"dt_bias", "e_score_correction_bias"}
    assert result.names == "transformers"
    main(["checkpoint", "reconcile", str(saved_dir)])
    assert "run again with --hf-names" in capsys.readouterr().out
    main(["checkpoint", "reconcile", str(saved_dir), "--hf-names"])
    assert "names: transformers' spellings, mapped to ours (--hf-names)" in capsys.readouterr().out


def test_reconcile_hf_names_sees_fused_slices_and_leaves_unknown_names_in_bucket_c(
        hf_model: Any, tmp_path: Path) -> None:
    """A raw state_dict (fused conv, merged experts) reconciles by slice shapes; an unknown name lands in (c)."""
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    state["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    result = reconcile_checkpoint(tmp_path, cfg=CFG, hf_names=True)
    assert [u.name for u in result.no_destination] == ["model.layers.0.self_attn.mystery.weight"]
    assert not (result.no_source or result.partial)
    assert result.num_matched == result.num_expected - len(result.mismatched)
