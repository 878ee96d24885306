"""Read a safetensors checkpoint directory's layout without loading tensors.

A checkpoint is `model.safetensors.index.json` + shards, or one `model.safetensors`. Opening a
`CheckpointReader` parses the index and every shard header (8-byte little-endian length + JSON) and
checks them against each other and against each file's size; tensors are read one at a time on
`get(name)`. The reader is a `Mapping[str, Tensor]`, so `loader.load_into(module, cfg, reader)` works.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from k3verify.checkpoint.writer import INDEX_FILE, ITEM_SIZES, SINGLE_FILE, TORCH_DTYPES, gc_paused

_MISSING: Any = object()
MAX_HEADER_BYTES = 512 * 1024 * 1024  # a K3 shard header is a few MB; anything near this is corrupt


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete or corrupt; the message names the file (and tensor)."""


class TensorEntry(NamedTuple):  # a NamedTuple: K3 has ~500k of them
    name: str
    dtype: str  # safetensors tag: BF16, F32, U8, ...
    shape: tuple[int, ...]
    file: str  # shard file name, relative to the checkpoint dir
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


@dataclass(frozen=True)
class CheckpointIndex:
    """What the index json says, without opening shards: {tensor name: shard file}."""

    path: Path
    weight_map: dict[str, str]
    total_size: int | None


def read_index(ckpt_dir: str | Path) -> CheckpointIndex:
    """The index of a sharded checkpoint, or a single file's tensor list (which needs its header)."""
    ckpt_dir = Path(ckpt_dir)
    index_path = ckpt_dir / INDEX_FILE
    if index_path.is_file():
        return parse_index(index_path.read_bytes(), index_path)
    single = ckpt_dir / SINGLE_FILE
    if single.is_file():
        entries = read_header(single)
        return CheckpointIndex(single, {name: SINGLE_FILE for name in entries}, None)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    raise CheckpointError(f"{ckpt_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} is present")


def parse_index(raw: bytes, index_path: Path) -> CheckpointIndex:
    """The index json's bytes as a CheckpointIndex (`index_path` names it in errors)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index_path}: not valid JSON: {exc}") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: missing or malformed 'weight_map'")
    total = (data.get("metadata") or {}).get("total_size")
    return CheckpointIndex(index_path, dict(weight_map), None if total is None else int(total))


def header_bytes_of(data: bytes | bytearray | memoryview, path: Path) -> bytes:
    """The raw header (length prefix included) of a safetensors file held in memory."""
    if len(data) < 8:
        raise CheckpointError(f"{path}: truncated: {len(data)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: corrupt header length {n}")
    if len(data) < 8 + n:
        raise CheckpointError(f"{path}: truncated inside the header ({len(data) - 8} of {n} bytes)")
    return bytes(data[: 8 + n])


def read_header_bytes(path: Path) -> bytes:
    """The raw header (length prefix included) of one safetensors file."""
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated: {len(prefix)} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: corrupt header length {n}")
            text = fh.read(n)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: shard file is missing") from exc
    if len(text) < n:
        raise CheckpointError(f"{path}: truncated inside the header ({len(text)} of {n} bytes)")
    return prefix + text


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse and validate one shard's header against its own file size (no tensor data is read)."""
    with gc_paused():
        return _read_header(Path(path))


def _read_header(path: Path) -> dict[str, TensorEntry]:
    return parse_header(read_header_bytes(path), path.stat().st_size, path)


def parse_header(raw: bytes, size: int, path: Path) -> dict[str, TensorEntry]:
    """A shard's header (its raw bytes, length prefix included) validated against the file's size `size`."""
    try:
        header = json.loads(raw[8:])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    base, file = len(raw), path.name
    entries: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            nbytes = math.prod(shape) * ITEM_SIZES[tag]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed or unsupported header entry "
                                  f"{info!r}") from exc
        if end - begin != nbytes or begin < 0 or not isinstance(nbytes, int):
            raise CheckpointError(f"{path}: tensor {name!r} {tag}{list(shape)} needs {nbytes} bytes but its "
                                  f"data_offsets are [{begin}, {end}]")
        entries[name] = TensorEntry(name, tag, shape, file, base + begin, base + end)
        spans.append((begin, end, name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            raise CheckpointError(f"{path}: tensor {name!r} data starts at {begin}, expected {cursor} "
                                  f"(gap or overlap in the data offsets)")
        cursor = end
    needed = base + cursor
    if size < needed:
        last = spans[-1][2] if spans else "(none)"
        raise CheckpointError(f"{path}: truncated: file has {size} bytes but the header needs {needed} "
                              f"(tensor {last!r} ends past the end of the file)")
    if size > needed:
        raise CheckpointError(f"{path}: {size - needed} trailing bytes after the last tensor")
    return entries


def match_index(ckpt_dir: Path, weight_map: Mapping[str, str],
                by_file: Mapping[str, dict[str, TensorEntry]]) -> dict[str, TensorEntry]:
    """Every tensor the index names, from its shard's header; raises naming the shard for a tensor the index names
    that its shard lacks, or one a shard holds that the index does not name."""
    entries: dict[str, TensorEntry] = {}
    for name, file in weight_map.items():
        if name not in by_file[file]:
            raise CheckpointError(f"{ckpt_dir / file}: tensor {name!r} is named by the index but absent from "
                                  f"this shard's header")
        entries[name] = by_file[file][name]
    for file, shard_entries in by_file.items():
        stray = sorted(n for n in shard_entries if weight_map.get(n) != file)
        if stray:
            raise CheckpointError(f"{ckpt_dir / file}: tensor(s) {stray[:4]} are in the shard but not in the index")
    return entries


class CheckpointReader(Mapping[str, torch.Tensor]):
    """Names, dtypes, shapes and offsets of every tensor in a checkpoint dir; tensors load one at a time."""

    def __init__(self, ckpt_dir: str | Path) -> None:
        with gc_paused():
            self._open(Path(ckpt_dir))
        self._handles: dict[str, Any] = {}

    def _open(self, ckpt_dir: Path) -> None:
        self.path = ckpt_dir
        self.index = read_index(self.path)
        self.shard_files = tuple(sorted(set(self.index.weight_map.values())))
        by_file: dict[str, dict[str, TensorEntry]] = {}
        for file in self.shard_files:
            shard = self.path / file
            if not shard.is_file():
                named = [n for n, f in self.index.weight_map.items() if f == file]
                raise CheckpointError(f"{shard}: shard file is missing (the index maps {len(named)} tensor(s) to it, "
                                      f"e.g. {named[0]!r})")
            by_file[file] = read_header(shard)
        self.entries = match_index(self.path, self.index.weight_map, by_file)

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def total_data_bytes(self) -> int:
        return sum(e.end - e.begin for e in self.entries.values())

    def get(self, name: str, default: Any = _MISSING) -> torch.Tensor:
        """Load one tensor; KeyError naming the checkpoint if absent (unlike dict.get, unless a default is given)."""
        entry = self.entries.get(name)
        if entry is None:
            if default is not _MISSING:
                return default
            raise KeyError(f"tensor {name!r} is not in checkpoint {self.path}")
        handle = self._handles.get(entry.file)
        try:
            if handle is None:
                handle = self._handles[entry.file] = safe_open(str(self.path / entry.file), framework="pt")
            return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.path / entry.file}: cannot read tensor {name!r}: {exc}") from exc

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Entries [start, stop) of tensor `name` along `dim`, read from the shard without the rest of the
        tensor (a tensor-parallel rank loads only its slice)."""
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(f"tensor {name!r} is not in checkpoint {self.path}")
        if not 0 <= dim < len(entry.shape) or not 0 <= start < stop <= entry.shape[dim]:
            raise CheckpointError(f"{self.path / entry.file}: tensor {name!r} {list(entry.shape)} has no slice "
                                  f"[{start}, {stop}) along dim {dim}")
        handle = self._handles.get(entry.file)
        try:
            if handle is None:
                handle = self._handles[entry.file] = safe_open(str(self.path / entry.file), framework="pt")
            index = (slice(None),) * dim + (slice(start, stop),)
            return handle.get_slice(name)[index]
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{self.path / entry.file}: cannot read a slice of tensor {name!r}: {exc}") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
