"""`k3verify checkpoint make` writes deterministic, atomic, sharded checkpoints; the digest pins identity."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from k3verify.checkpoint.digest import checkpoint_digest
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.synthetic import make_synthetic_checkpoint
from k3verify.checkpoint.writer import INDEX_FILE, write_checkpoint
from k3verify.cli import main
from k3verify.presets import SYNTHETIC_PRESETS


def _file_hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _make(out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `k3verify checkpoint make --preset k3-tiny [extra] OUT`."""
    rc = main(["checkpoint", "make", "--preset", "k3-tiny", *extra, str(out)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_make_twice_gives_identical_files_and_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Same preset and seed through the CLI -> every file byte-identical, same printed digest."""
    rc_a, out_a, _ = _make(tmp_path / "a", capsys)
    rc_b, out_b, _ = _make(tmp_path / "b", capsys)
    assert rc_a == rc_b == 0
    hashes = _file_hashes(tmp_path / "a")
    assert hashes == _file_hashes(tmp_path / "b")
    assert {"config.json", "generation_config.json", INDEX_FILE, "model-00001-of-00003.safetensors"} <= set(hashes)
    digest = checkpoint_digest(tmp_path / "a")
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert f"digest {digest}" in out_a and f"digest {digest}" in out_b
    assert "399 tensors in 3 shards" in out_a


def test_different_seed_changes_the_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Same shapes, different weights: the digest's data samples tell them apart."""
    _make(tmp_path / "s0", capsys)
    _make(tmp_path / "s1", capsys, "--seed", "1")
    assert checkpoint_digest(tmp_path / "s0") != checkpoint_digest(tmp_path / "s1")


@pytest.mark.parametrize("name", SYNTHETIC_PRESETS)
def test_every_synthetic_preset_writes_at_least_two_shards(name: str, tmp_path: Path) -> None:
    """Shards are small enough that the index path is always exercised."""
    written = make_synthetic_checkpoint(name, tmp_path / name)
    assert len(written.shard_files) >= 2
    index = json.loads((tmp_path / name / INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == list(written.shard_files)
    assert index["metadata"]["total_size"] == written.total_size == CheckpointReader(tmp_path / name).total_data_bytes


def test_written_tensors_read_back_bit_exact_with_their_dtypes(k3_tiny_dir: Path) -> None:
    from k3verify.checkpoint.synthetic_weights import synthetic_tensors
    from k3verify.presets import get_preset

    expected = synthetic_tensors(get_preset("k3-tiny"), seed=0)
    with CheckpointReader(k3_tiny_dir) as reader:
        assert list(reader) == sorted(expected)
        for name, value in expected.items():
            got = reader.get(name)
            assert got.dtype == value.dtype and torch.equal(got, value), name


def test_digest_is_independent_of_file_creation_order(k3_tiny_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in sorted(k3_tiny_dir.iterdir(), reverse=True):
        shutil.copyfile(path, copy / path.name)
    assert checkpoint_digest(copy) == checkpoint_digest(k3_tiny_dir)


@pytest.mark.parametrize("victim", ["config.json", "generation_config.json", "tokenizer_config.json", INDEX_FILE])
def test_digest_changes_with_each_covered_file(victim: str, k3_tiny_dir: Path, tmp_path: Path) -> None:
    if not (k3_tiny_dir / victim).exists():
        pytest.skip(f"{victim} not present (tokenizer assets not built yet)")
    copy = tmp_path / "copy"
    shutil.copytree(k3_tiny_dir, copy)
    with open(copy / victim, "a") as fh:
        fh.write(" ")
    assert checkpoint_digest(copy) != checkpoint_digest(k3_tiny_dir)


def test_make_refuses_a_non_empty_out_dir_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = _make(out, capsys)
    assert rc == 2 and "already exists" in err
    assert (out / "keep.txt").read_text() == "mine"
    rc, _, _ = _make(out, capsys, "--force")
    assert rc == 0 and not (out / "keep.txt").exists()


def test_make_refuses_a_real_shape_without_sparse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "make", "--preset", "k3", str(tmp_path / "k3")]) == 2
    assert "--sparse" in capsys.readouterr().err
    assert not (tmp_path / "k3").exists()


class _Exploding(Mapping[str, torch.Tensor]):
    """Tensors whose last value fails to load: the writer must leave nothing behind."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._t = tensors
        self.last = sorted(tensors)[-1]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == self.last and getattr(self, "armed", False):
            raise RuntimeError(f"disk fell off while writing {name}")
        return self._t[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def items(self):  # type: ignore[override]
        items = list(self._t.items())
        self.armed = True  # shapes/dtypes are read first; the failure strikes during the data write
        return items


def test_failed_write_leaves_no_partial_directory(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.full((1000,), float(i)) for i in range(5)}
    with pytest.raises(RuntimeError, match="disk fell off"):
        write_checkpoint({"model_type": "x"}, _Exploding(tensors), tmp_path / "out", shard_max_bytes=4000,
                         generation_config=None)
    assert list(tmp_path.iterdir()) == []
    written = write_checkpoint({"model_type": "x"}, tensors, tmp_path / "out", shard_max_bytes=4000,
                               generation_config=None)
    assert written.shard_files == tuple(f"model-0000{i}-of-00005.safetensors" for i in range(1, 6))
