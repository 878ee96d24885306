"""The digest covers every byte of every shard (the edits of issue 15 that used to pass the gate now change it),
and its per-file cache cannot be fooled by `touch -r` nor by a file replaced under the same name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

import k3verify.checkpoint.digest as digest_mod
from k3verify.checkpoint.digest import DigestCache, checkpoint_digest
from k3verify.checkpoint.reader import CheckpointError, read_index


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def biggest_shard(ckpt: Path) -> Path:
    return max((ckpt / s for s in set(read_index(ckpt).weight_map.values())), key=lambda p: p.stat().st_size)


def fresh() -> DigestCache:
    return DigestCache(None, racy_s=0.0)


def flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.seek(path.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x01]))


def test_a_byte_flipped_mid_shard_changes_the_digest(k3_tiny_dir: Path, tmp_path: Path) -> None:
    """The edit issue 15 found passing the gate: one bit in the middle of a shard, far from the 256 KiB ends."""
    copy = copy_of(k3_tiny_dir, tmp_path / "c")
    shard = biggest_shard(copy)
    assert shard.stat().st_size > 3 * 256 * 1024, "shard too small to have a middle outside the old samples"
    flip_middle_byte(shard)
    assert checkpoint_digest(copy, fresh()) != checkpoint_digest(k3_tiny_dir, fresh())


def test_a_nan_tensor_written_mid_shard_changes_the_digest(k3_tiny_dir: Path, tmp_path: Path) -> None:
    """Overwrite the fp32/bf16 data of the tensor nearest the middle of a shard with NaN: the digest moves."""
    copy = copy_of(k3_tiny_dir, tmp_path / "c")
    shard = biggest_shard(copy)
    raw = shard.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + header_len])
    middle = shard.stat().st_size // 2
    name, info = min(((k, v) for k, v in header.items() if k != "__metadata__" and v["dtype"] in ("F32", "BF16")),
                     key=lambda kv: abs(8 + header_len + kv[1]["data_offsets"][0] - middle))
    start, end = (8 + header_len + o for o in info["data_offsets"])
    nan = b"\x00\x00\xc0\x7f" if info["dtype"] == "F32" else b"\xc0\x7f"
    with open(shard, "r+b") as fh:
        fh.seek(start)
        fh.write(nan * ((end - start) // len(nan)))
    assert checkpoint_digest(copy, fresh()) != checkpoint_digest(k3_tiny_dir, fresh()), name


def test_in_place_edit_with_mtime_restored_is_caught_by_a_warm_cache(k3_tiny_dir: Path, tmp_path: Path) -> None:
    """`touch -r`-style: same size, same mtime after an in-place edit; ctime still moves, so the cache misses."""
    copy = copy_of(k3_tiny_dir, tmp_path / "c")
    cache = fresh()
    before = checkpoint_digest(copy, cache)
    shard = biggest_shard(copy)
    st = shard.stat()
    flip_middle_byte(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    assert checkpoint_digest(copy, cache) != before


def test_file_replaced_under_the_same_name_is_rehashed(k3_tiny_dir: Path, tmp_path: Path) -> None:
    """A shard swapped for an edited copy (new inode) with size and times copied over is hashed again."""
    copy = copy_of(k3_tiny_dir, tmp_path / "c")
    cache = fresh()
    before = checkpoint_digest(copy, cache)
    shard = biggest_shard(copy)
    edited = tmp_path / "edited"
    shutil.copy2(shard, edited)
    flip_middle_byte(edited)
    os.replace(edited, shard)
    assert checkpoint_digest(copy, cache) != before


def test_warm_cache_reads_no_shard_again(k3_tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-run with unchanged files hashes nothing but the digest itself (the per-file hashes are cached)."""
    made: list[int] = []

    class CountingHashlib:
        @staticmethod
        def sha256(*args: Any) -> Any:
            made.append(1)
            return hashlib.sha256(*args)

    monkeypatch.setattr(digest_mod, "hashlib", CountingHashlib)
    cache = fresh()
    cold = checkpoint_digest(k3_tiny_dir, cache)
    cold_hashes = len(made)
    assert checkpoint_digest(k3_tiny_dir, cache) == cold
    assert cold_hashes > 4 and len(made) - cold_hashes == 1


def test_recently_changed_files_are_not_cached(k3_tiny_dir: Path, tmp_path: Path) -> None:
    """A file touched within RACY_S of hashing is left out of the cache (an edit in the same tick could hide)."""
    copy = copy_of(k3_tiny_dir, tmp_path / "c")
    cache = DigestCache(None)  # default racy window; the copy was just written
    checkpoint_digest(copy, cache)
    assert cache.entries == {}


def test_cache_persists_and_a_corrupt_cache_is_ignored(k3_tiny_dir: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The cache round-trips through its JSON file; a garbled file only costs a re-hash (with a warning)."""
    path = tmp_path / "digests.json"
    cache = DigestCache.load(path)
    cache.racy_s = 0.0
    digest = checkpoint_digest(k3_tiny_dir, cache)
    assert path.is_file() and DigestCache.load(path).entries == cache.entries
    path.write_text("{not json")
    assert checkpoint_digest(k3_tiny_dir, DigestCache.load(path)) == digest
    assert "ignoring the digest cache" in caplog.text


def test_missing_or_unreadable_shard_names_the_file(k3_tiny_dir: Path, tmp_path: Path) -> None:
    """A shard the index names but the dir lacks, or one that cannot be read, is a CheckpointError naming it."""
    copy = copy_of(k3_tiny_dir, tmp_path / "c")
    shard = biggest_shard(copy)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing"):
        checkpoint_digest(copy, fresh())
    shard.mkdir()  # reading a directory fails even for root, who ignores file permissions
    with pytest.raises(CheckpointError, match=f"{shard.name}: cannot be read"):
        checkpoint_digest(copy, fresh())
