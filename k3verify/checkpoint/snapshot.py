"""A checkpoint held in memory: every file the digest covers read once, and the digest computed from those bytes.

Why: `serve` must serve what its gate report vouched for. Checking a directory's digest and then reading the
files again (the weights, later the tokenizer in another process) leaves a window in which a file can be swapped:
the digest says one thing, the server loads another. A snapshot closes it: config, index, shards and tokenizer
files are read once into memory, hashed there (the same digest as checkpoint/digest.py, without its cache: the
hash is of these bytes, not of what a stat key remembers), and everything served is built from these bytes.
Nothing reads the directory again by path.

Cost: the shards are held in host memory until the model has copied them (`drop_shards`); the tokenizer and
config files (kilobytes to megabytes) are kept, so a restarted front end gets the same bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3verify.checkpoint.digest import CONFIG_FILES, digest_of, tokenizer_files
from k3verify.checkpoint.reader import (
    CheckpointError,
    TensorEntry,
    header_bytes_of,
    match_index,
    parse_header,
    parse_index,
)
from k3verify.checkpoint.writer import INDEX_FILE, SINGLE_FILE


def read_whole(path: Path) -> bytearray:
    """Every byte of `path`, read once; CheckpointError naming it when missing, unreadable or changed in size while
    it was read."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            buf = bytearray(size)
            got = fh.readinto(buf)
            extra = fh.read(1)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint needs this file)") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if got != size or extra:
        raise CheckpointError(f"{path}: changed size while it was read ({size} bytes at open)")
    return buf


@dataclass
class CheckpointSnapshot:
    """The bytes of every covered file by name relative to `directory` (digest order), and their digest."""

    directory: Path
    files: dict[str, bytearray]
    digest: str
    shards: tuple[str, ...]
    entries: dict[str, TensorEntry] = field(default_factory=dict)

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> CheckpointSnapshot:
        """Read every covered file once (config files, index, the shards the index names, tokenizer files); the
        shard list comes from the index bytes read here, so the digest and the weights agree on it."""
        ckpt_dir = Path(ckpt_dir)
        if not (ckpt_dir / "config.json").is_file():
            raise CheckpointError(f"{ckpt_dir / 'config.json'}: missing (a checkpoint dir needs its config)")
        files = {name: read_whole(ckpt_dir / name) for name in CONFIG_FILES if (ckpt_dir / name).is_file()}
        if (ckpt_dir / INDEX_FILE).is_file():
            files[INDEX_FILE] = read_whole(ckpt_dir / INDEX_FILE)
            weight_map = parse_index(bytes(files[INDEX_FILE]), ckpt_dir / INDEX_FILE).weight_map
        elif (ckpt_dir / SINGLE_FILE).is_file():
            weight_map = {}
        else:
            raise CheckpointError(f"{ckpt_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} is present")
        shards = tuple(sorted(set(weight_map.values()))) or (SINGLE_FILE,)
        for shard in shards:
            files[shard] = read_whole(ckpt_dir / shard)
        by_file = {shard: parse_header(header_bytes_of(files[shard], ckpt_dir / shard), len(files[shard]),
                                       ckpt_dir / shard) for shard in shards}
        if not weight_map:  # a single-file checkpoint: its header is its index
            weight_map = {name: SINGLE_FILE for name in by_file[SINGLE_FILE]}
        entries = match_index(ckpt_dir, weight_map, by_file)
        for path in tokenizer_files(ckpt_dir):
            files[path.name] = read_whole(path)
        digest = digest_of((name, len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items())
        return cls(ckpt_dir, files, digest, shards, entries)

    def data(self, name: str) -> bytes:
        """The bytes of one covered file (a copy); KeyError naming what the snapshot holds."""
        if name not in self.files:
            raise KeyError(f"{name!r} is not a file the checkpoint digest covers in {self.directory}; covered: "
                           f"{', '.join(self.files)}")
        return bytes(self.files[name])

    def text_files(self) -> dict[str, bytes]:
        """Every covered file but the shards (config, index, tokenizer files): small, kept for restarts."""
        return {name: bytes(data) for name, data in self.files.items() if name not in self.shards}

    def tensors(self) -> SnapshotTensors:
        """The shards' tensors by checkpoint name, built from the snapshot's bytes."""
        missing = [s for s in self.shards if s not in self.files]
        if missing:
            raise CheckpointError(f"{self.directory}: the snapshot's shards were dropped ({missing[0]}); read it again")
        return SnapshotTensors(self.directory, {s: self.files[s] for s in self.shards}, self.entries)

    def drop_shards(self) -> None:
        """Free the shards' bytes once the model holds its own copy of the weights."""
        for shard in self.shards:
            self.files.pop(shard, None)


class SnapshotTensors(Mapping[str, torch.Tensor]):
    """A snapshot's tensors (a Mapping like CheckpointReader, so loader.load_into takes it): each access copies
    the tensor out of the held bytes, which stay as they were hashed."""

    def __init__(self, directory: Path, shards: dict[str, bytearray], entries: dict[str, TensorEntry]) -> None:
        self.path, self._shards, self.entries = directory, shards, entries

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(f"tensor {name!r} is not in checkpoint {self.path}")
        numel = (entry.end - entry.begin) // max(1, torch.empty((), dtype=entry.torch_dtype).element_size())
        if numel == 0:
            return torch.empty(entry.shape, dtype=entry.torch_dtype)
        flat = torch.frombuffer(self._shards[entry.file], dtype=entry.torch_dtype, count=numel, offset=entry.begin)
        return flat.reshape(entry.shape).clone()

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Entries [start, stop) of tensor `name` along `dim` (as CheckpointReader.get_slice)."""
        whole = self[name]
        if not 0 <= dim < whole.dim() or not 0 <= start < stop <= whole.shape[dim]:
            raise CheckpointError(f"{self.path / self.entries[name].file}: tensor {name!r} {list(whole.shape)} has no "
                                  f"slice [{start}, {stop}) along dim {dim}")
        return whole.narrow(dim, start, stop - start).clone()

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries
