"""CheckpointReader: headers without data, errors that name the file and tensor, strict load_into through it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from k3verify.checkpoint import mxfp4
from k3verify.checkpoint.buckets import build_param_module
from k3verify.checkpoint.loader import WeightLoadError, load_into
from k3verify.checkpoint.names import TensorSpec, module_specs
from k3verify.checkpoint.reader import CheckpointError, CheckpointReader
from k3verify.checkpoint.writer import INDEX_FILE, SINGLE_FILE, write_checkpoint
from k3verify.cli import main
from k3verify.config import ModelConfig

SHARD1 = "model-00001-of-00003.safetensors"
SHARD3 = "model-00003-of-00003.safetensors"


@pytest.fixture
def copy(k3_tiny_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(k3_tiny_dir, out)
    return out


def _expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(path)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"


def test_reader_lists_every_tensor_without_loading(k3_tiny_dir: Path) -> None:
    reader = CheckpointReader(k3_tiny_dir)
    cfg = ModelConfig.from_file(k3_tiny_dir)
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    entry = reader.entries[name]
    assert (entry.dtype, entry.shape) == ("U8", (cfg.moe_intermediate_size, cfg.expert_in_dim // 2))
    assert entry.torch_dtype == torch.uint8 and entry.file.startswith("model-0000")
    assert len(reader) == 399 and name in reader and reader.shard_files[-1] == SHARD3
    assert reader.get(name).shape == entry.shape


def test_truncated_shard_is_an_error_naming_the_file(copy: Path) -> None:
    shard = copy / SHARD3
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 10)
    _expect_error(copy, str(shard), "truncated", "ends past the end of the file")


def test_shard_truncated_inside_its_header_is_an_error_naming_the_file(copy: Path) -> None:
    shard = copy / SHARD1
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    _expect_error(copy, str(shard), "truncated inside the header")


def test_header_that_does_not_parse_is_an_error_naming_the_file(copy: Path) -> None:
    shard = copy / SHARD1
    data = bytearray(shard.read_bytes())
    data[8:12] = b"{{{{"
    shard.write_bytes(bytes(data))
    _expect_error(copy, str(shard), "not valid JSON")


def test_corrupt_header_length_is_an_error_naming_the_file(copy: Path) -> None:
    shard = copy / SHARD1
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    shard.write_bytes(bytes(data))
    _expect_error(copy, str(shard), "corrupt header length")


def test_index_naming_a_missing_shard_is_an_error_naming_the_file(copy: Path) -> None:
    (copy / SHARD3).unlink()
    _expect_error(copy, str(copy / SHARD3), "shard file is missing")


def test_index_entry_absent_from_its_shard_names_tensor_and_file(copy: Path) -> None:
    index = json.loads((copy / INDEX_FILE).read_text())
    name = "language_model.lm_head.weight"
    wrong = SHARD1 if index["weight_map"][name] != SHARD1 else SHARD3
    index["weight_map"][name] = wrong
    (copy / INDEX_FILE).write_text(json.dumps(index))
    _expect_error(copy, str(copy / wrong), repr(name), "absent from this shard's header")


def test_shard_tensor_missing_from_the_index_is_an_error(copy: Path) -> None:
    index = json.loads((copy / INDEX_FILE).read_text())
    file = index["weight_map"].pop("language_model.model.norm.weight")
    (copy / INDEX_FILE).write_text(json.dumps(index))
    _expect_error(copy, str(copy / file), "language_model.model.norm.weight", "not in the index")


def test_corrupt_checkpoint_through_the_cli_exits_2_naming_the_file(copy: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    shard = copy / SHARD3
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 1)
    assert main(["checkpoint", "reconcile", str(copy)]) == 2
    assert str(shard) in capsys.readouterr().err


def test_single_file_checkpoint_is_read_without_an_index(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    write_checkpoint({"model_type": "x"}, tensors, tmp_path / "multi", shard_max_bytes=1 << 20, generation_config=None)
    single = tmp_path / "single"
    single.mkdir()
    shutil.copyfile(tmp_path / "multi" / "model-00001-of-00001.safetensors", single / SINGLE_FILE)
    reader = CheckpointReader(single)
    assert reader.shard_files == (SINGLE_FILE,)
    assert torch.equal(reader["a"], tensors["a"]) and reader["b"].dtype == torch.bfloat16


def test_load_into_a_meta_module_through_the_reader_succeeds(k3_tiny_dir: Path) -> None:
    """The strict name plan holds on the meta device (no data moves)."""
    cfg = ModelConfig.from_file(k3_tiny_dir)
    module = build_param_module(module_specs(cfg), device="meta")
    load_into(module, cfg, CheckpointReader(k3_tiny_dir))


def test_load_into_a_cpu_module_through_the_reader_copies_every_value(
        k3_tiny_dir: Path, k3_tiny_tensors: dict[str, torch.Tensor]) -> None:
    cfg = ModelConfig.from_file(k3_tiny_dir)
    module = build_param_module(module_specs(cfg), device="cpu")
    load_into(module, cfg, CheckpointReader(k3_tiny_dir))
    state = module.state_dict()
    assert len(state) == 396
    for name, value in state.items():
        assert torch.equal(value, k3_tiny_tensors[cfg.checkpoint_prefix + name]), name


def test_load_into_dense_experts_dequantizes_the_pair(k3_tiny_dir: Path,
                                                      k3_tiny_tensors: dict[str, torch.Tensor]) -> None:
    """An oracle-style module holding dense wN.weight is filled from weight_packed + weight_scale."""
    cfg = ModelConfig.from_file(k3_tiny_dir)
    specs: dict[str, TensorSpec] = {}
    for name, spec in module_specs(cfg).items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            name = name.removesuffix("_packed")
            spec = TensorSpec((spec.shape[0], spec.shape[1] * 2), torch.float32, spec.role)
        specs[name] = spec
    module = build_param_module(specs, device="cpu")
    load_into(module, cfg, CheckpointReader(k3_tiny_dir))
    base = "language_model.model.layers.2.block_sparse_moe.experts.5.w2"
    expected = mxfp4.dequantize(k3_tiny_tensors[f"{base}.weight_packed"], k3_tiny_tensors[f"{base}.weight_scale"])
    assert torch.equal(module.state_dict()[base.removeprefix("language_model.") + ".weight"], expected)


def test_load_into_rejects_a_tensor_outside_the_prefix(k3_tiny_tensors: dict[str, torch.Tensor],
                                                       k3_tiny_dir: Path) -> None:
    """A stray un-prefixed tensor is reported as unexpected, not a KeyError crash (loader fix)."""
    cfg = ModelConfig.from_file(k3_tiny_dir)
    tensors = dict(k3_tiny_tensors) | {"stray.weight": torch.zeros(1)}
    with pytest.raises(WeightLoadError, match=r"1 checkpoint tensor\(s\) without a destination \['stray.weight'\]"):
        load_into(build_param_module(module_specs(cfg), device="meta"), cfg, tensors)
