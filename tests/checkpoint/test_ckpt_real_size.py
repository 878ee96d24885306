"""Real-width checkpoints: written with data shard by shard (same bytes as all at once), a tokenizer widened to the
real id layout, a refusal when the disk cannot hold it, and the full 48B shape reconciled on the meta device."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from k3verify.checkpoint.buckets import expected_from_module, reconcile_checkpoint
from k3verify.checkpoint.names import checkpoint_specs
from k3verify.checkpoint.synthetic import _tokenizer_writer, make_sparse_checkpoint
from k3verify.checkpoint.synthetic_weights import synthetic_group, synthetic_tensors
from k3verify.checkpoint.writer import write_checkpoint, write_streamed_checkpoint
from k3verify.cli import main
from k3verify.presets import get_preset, preset_hf_config
from k3verify.serving.model import ServingModel
from k3verify.tokenizer import KimiTokenizer, default_tokenizer


def test_streamed_writer_makes_one_shard_at_a_time_with_the_same_bytes(tmp_path: Path) -> None:
    """produce() is asked for exactly one shard's names per call; the files equal an all-at-once write."""
    cfg = get_preset("k3-tiny")
    specs = checkpoint_specs(cfg)
    calls: list[list[str]] = []

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        calls.append(names)
        return synthetic_group(cfg, specs, names)

    layout = {n: (s.shape, s.dtype) for n, s in specs.items()}
    shards: list[tuple[str, int]] = []
    streamed = write_streamed_checkpoint(preset_hf_config("k3-tiny"), layout, produce, tmp_path / "streamed",
                                         shard_max_bytes=1 << 19, generation_config=None,
                                         on_shard=lambda f, n: shards.append((f, n)))
    whole = write_checkpoint(preset_hf_config("k3-tiny"), synthetic_tensors(cfg), tmp_path / "whole",
                             shard_max_bytes=1 << 19, generation_config=None)
    assert len(calls) == len(streamed.shard_files) == len(shards) > 2
    assert sorted(n for c in calls for n in c) == sorted(specs)
    assert [f for f, _ in shards] == list(streamed.shard_files)
    for f in ("config.json", "model.safetensors.index.json", *whole.shard_files):
        assert (tmp_path / "streamed" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


def test_a_produced_tensor_that_breaks_the_layout_is_refused(tmp_path: Path) -> None:
    specs = {"a": ((2, 3), torch.bfloat16)}
    with pytest.raises(ValueError, match=r"tensor 'a': produced torch.float32 \(2, 3\), the layout says BF16"):
        write_streamed_checkpoint({}, specs, lambda names: {"a": torch.zeros(2, 3)}, tmp_path / "x",
                                  shard_max_bytes=1 << 20, generation_config=None)
    assert not (tmp_path / "x").exists()


def test_real_shapes_get_the_project_tokenizer_widened_to_their_ids(tmp_path: Path) -> None:
    """kl-48b-8l names [BOS] 163584, [EOS] 163585, <|im_end|> 163586, [PAD] 163839: the widened vocabulary has
    them there, and encodes text exactly as the project's tokenizer (no filler token is reachable)."""
    cfg = get_preset("kl-48b-8l")
    write = _tokenizer_writer(cfg)
    assert write is not None
    write(tmp_path)
    tok = KimiTokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.im_end_id, tok.pad_id) == (163584, 163585, 163586, 163839)
    assert set(cfg.eos_token_ids) == {tok.eos_id, tok.im_end_id}
    text = "Hello, wörld! 中文 😀 <|im_end|> [EOS] \x00\xff " + "".join(chr(c) for c in range(0x20, 0x2500, 7))
    ids = tok.encode(text)
    assert ids == default_tokenizer().encode(text) and max(ids) < 4096
    assert tok.decode(ids) == text


def test_make_refuses_a_shape_the_disk_cannot_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The full Kimi-Linear-48B (~98 GB in bf16) on a 64 GiB disk: refused before writing, naming --sparse / plan."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 30, 0, 60 << 30))
    assert main(["checkpoint", "make", "--preset", "kimi-linear-48b", str(tmp_path / "kl48b")]) == 2
    err = capsys.readouterr().err
    assert "needs 98.2 GB of data" in err and "--sparse" in err and "k3verify plan" in err
    assert not (tmp_path / "kl48b").exists()


def test_full_kimi_linear_48b_reconciles_on_the_meta_device(tmp_path: Path) -> None:
    """Exact headers (sparse, no data) against the serving model's own parameters built on the meta device."""
    ckpt = make_sparse_checkpoint("kimi-linear-48b", tmp_path / "kl48b").path
    cfg = get_preset("kimi-linear-48b")
    model = ServingModel(cfg, torch.bfloat16, "meta")
    result = reconcile_checkpoint(ckpt, cfg=cfg, expected=expected_from_module(model, exact_dtype=False))
    assert result.ok and result.num_matched == result.num_expected == len(checkpoint_specs(cfg))
