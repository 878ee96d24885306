"""Deterministic, atomic checkpoint writer: config.json, generation_config.json, sharded safetensors + index.

Same inputs give identical bytes: JSON is written with sorted keys and fixed indentation, tensors are
assigned to shards in natural name order, each shard's safetensors header is serialized here (no
timestamps, metadata is exactly {"format": "pt"}), and data within a shard is laid out by descending
element size then name, so every tensor starts at an offset aligned to its element size.
The directory appears whole or not at all: everything is written into a temp dir next to `out_dir`
and renamed into place.

`write_sparse_checkpoint` writes the same layout for real shapes without materialising data: shard
files are extended with `truncate`, so the headers are exact and the data reads as zeros while
occupying no disk blocks (reconcile / planning fixtures for the ~1.4 TiB K3; not a model).
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# torch dtype <-> safetensors dtype tag
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES: dict[str, torch.dtype] = {tag: dt for dt, tag in ST_DTYPES.items()}
ITEM_SIZES: dict[str, int] = {tag: torch.empty((), dtype=dt).element_size() for dt, tag in ST_DTYPES.items()}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building a K3-sized header (~500k entries, millions of small acyclic
    objects): each allocation burst would otherwise rescan everything built so far (3-4x slower)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class WrittenCheckpoint:
    path: Path
    shard_files: tuple[str, ...]
    num_tensors: int
    total_size: int  # bytes of tensor data over all shards (the index's metadata.total_size)


def shard_file_name(i: int, n: int) -> str:
    """1-based shard `i` of `n`, in the Hugging Face spelling."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


_DIGITS = re.compile(r"\d+")


def natural_key(name: str) -> str:
    """`layers.2` before `layers.10`: digit runs are zero-padded so they compare as numbers."""
    return _DIGITS.sub(lambda m: m.group().zfill(20), name)


def stable_json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def plan_shards(sizes: Mapping[str, int], shard_max_bytes: int) -> list[list[str]]:
    """Greedy split of tensors (natural name order) into shards of at most `shard_max_bytes` data bytes.

    A tensor larger than the limit gets a shard of its own. Each shard lists its names in natural order."""
    if shard_max_bytes <= 0:
        raise ValueError(f"shard_max_bytes must be positive; got {shard_max_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in sorted(sizes, key=natural_key):
        if current and used + sizes[name] > shard_max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += sizes[name]
    if current:
        shards.append(current)
    return shards


def build_header(entries: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[bytes, list[str], int]:
    """safetensors header bytes (length prefix included) for {name: (dtype tag, shape)}.

    Data order is by descending element size, then the mapping's own order (sort is stable).
    Returns (header bytes, names in data order, data length)."""
    order = sorted(entries, key=lambda n: -ITEM_SIZES[entries[n][0]])
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        tag, shape = entries[name]
        nbytes = math.prod(shape) * ITEM_SIZES[tag]
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order, offset


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a view (no copy beyond the move to host: a real-size shard is 4 GiB)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


def _dtype_tag(name: str, dtype: torch.dtype) -> str:
    if dtype not in ST_DTYPES:
        raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors spelling")
    return ST_DTYPES[dtype]


def _write_common(tmp: Path, cfg_dict: dict[str, Any], generation_config: dict[str, Any] | None) -> None:
    (tmp / "config.json").write_bytes(stable_json(cfg_dict))
    if generation_config is not None:
        (tmp / "generation_config.json").write_bytes(stable_json(generation_config))


def _write_index(tmp: Path, shards: list[list[str]], total: int) -> tuple[str, ...]:
    files = tuple(shard_file_name(i + 1, len(shards)) for i in range(len(shards)))
    weight_map = {name: files[i] for i, names in enumerate(shards) for name in names}
    (tmp / INDEX_FILE).write_bytes(stable_json({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return files


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished temp dir to `out_dir` (an existing empty dir is replaced)."""
    if out_dir.exists():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        elif overwrite:
            trash = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            out_dir.rename(trash)
            shutil.rmtree(trash)
        else:
            raise FileExistsError(f"{out_dir} already exists and is not empty (pass overwrite to replace it)")
    try:
        tmp.rename(out_dir)
    except OSError as exc:
        raise FileExistsError(f"could not move the finished checkpoint into {out_dir}: {exc}") from exc


def _atomic_write(out_dir: str | Path, overwrite: bool, fill: Any) -> WrittenCheckpoint:
    with gc_paused():
        return _atomic_write_inner(Path(out_dir).absolute(), overwrite, fill)


def _atomic_write_inner(out_dir: Path, overwrite: bool, fill: Any) -> WrittenCheckpoint:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        files, num, total, extra_files = fill(tmp)
        for rel, data in sorted(extra_files.items()):  # e.g. a completion marker: written last
            (tmp / rel).write_bytes(data)
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WrittenCheckpoint(path=out_dir, shard_files=files, num_tensors=num, total_size=total)


def write_checkpoint(cfg_dict: dict[str, Any], tensors: Mapping[str, torch.Tensor], out_dir: str | Path, *,
                     shard_max_bytes: int, generation_config: dict[str, Any] | None,
                     tokenizer_dir: str | Path | None = None, overwrite: bool = False,
                     extra_files: Mapping[str, bytes] | None = None) -> WrittenCheckpoint:
    """Write a complete checkpoint directory; identical inputs give byte-identical files.

    `extra_files` ({relative name: bytes}) are written after everything else, just before the rename."""
    specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    tokenizer = None if tokenizer_dir is None else _copy_tokenizer(Path(tokenizer_dir))
    return write_streamed_checkpoint(cfg_dict, specs, lambda names: {n: tensors[n] for n in names}, out_dir,
                                     shard_max_bytes=shard_max_bytes, generation_config=generation_config,
                                     tokenizer=tokenizer, overwrite=overwrite, extra_files=extra_files)


Produce = Callable[[list[str]], Mapping[str, torch.Tensor]]  # the tensors of one shard, by name


def write_streamed_checkpoint(cfg_dict: dict[str, Any], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                              produce: Produce, out_dir: str | Path, *, shard_max_bytes: int,
                              generation_config: dict[str, Any] | None,
                              tokenizer: Callable[[Path], None] | None = None, overwrite: bool = False,
                              extra_files: Mapping[str, bytes] | None = None,
                              on_shard: Callable[[str, int], None] | None = None) -> WrittenCheckpoint:
    """Write a checkpoint whose tensors exist one shard at a time: the layout comes from `specs`, then
    `produce(names)` makes each shard's tensors, which are written and dropped before the next shard (memory
    bounded by one shard). Same bytes as writing the same tensors all at once. `tokenizer(dir)` writes the
    tokenizer files; `on_shard(file, bytes)` is told after each shard (progress)."""
    entries = {name: (_dtype_tag(name, dtype), tuple(shape)) for name, (shape, dtype) in specs.items()}
    sizes = {name: math.prod(shape) * ITEM_SIZES[tag] for name, (tag, shape) in entries.items()}

    def fill(tmp: Path) -> tuple[tuple[str, ...], int, int, Mapping[str, bytes]]:
        _write_common(tmp, cfg_dict, generation_config)
        if tokenizer is not None:
            tokenizer(tmp)
        shards = plan_shards(sizes, shard_max_bytes)
        files = _write_index(tmp, shards, sum(sizes.values()))
        for file, names in zip(files, shards, strict=True):
            header, order, data_len = build_header({n: entries[n] for n in names})
            tensors = produce(list(names))
            with open(tmp / file, "wb") as fh:
                fh.write(header)
                for name in order:
                    _check_produced(name, tensors[name], entries[name])
                    fh.write(_tensor_bytes(tensors[name]))
            del tensors
            if on_shard is not None:
                on_shard(file, data_len)
        return files, len(entries), sum(sizes.values()), extra_files or {}

    return _atomic_write(out_dir, overwrite, fill)


def _check_produced(name: str, value: torch.Tensor, entry: tuple[str, tuple[int, ...]]) -> None:
    tag, shape = entry
    if _dtype_tag(name, value.dtype) != tag or tuple(value.shape) != shape:
        raise ValueError(f"tensor {name!r}: produced {value.dtype} {tuple(value.shape)}, the layout says {tag} "
                         f"{shape}")


def _copy_tokenizer(src: Path) -> Callable[[Path], None]:
    def copy(tmp: Path) -> None:
        for path in sorted(src.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.suffix != ".py":
                shutil.copyfile(path, tmp / path.name)
    return copy


def write_sparse_checkpoint(cfg_dict: dict[str, Any], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                            out_dir: str | Path, *, shard_max_bytes: int, generation_config: dict[str, Any] | None,
                            overwrite: bool = False) -> WrittenCheckpoint:
    """Exact headers for {name: (shape, dtype)}, all data zero and unallocated (sparse files)."""
    entries = {name: (_dtype_tag(name, dtype), tuple(shape)) for name, (shape, dtype) in specs.items()}
    sizes = {name: math.prod(shape) * ITEM_SIZES[tag] for name, (tag, shape) in entries.items()}

    def fill(tmp: Path) -> tuple[tuple[str, ...], int, int, Mapping[str, bytes]]:
        _write_common(tmp, cfg_dict, generation_config)
        shards = plan_shards(sizes, shard_max_bytes)
        files = _write_index(tmp, shards, sum(sizes.values()))
        for file, names in zip(files, shards, strict=True):
            header, _, data_len = build_header({n: entries[n] for n in names})
            with open(tmp / file, "wb") as fh:
                fh.write(header)
                fh.truncate(len(header) + data_len)
        return files, len(entries), sum(sizes.values()), {}

    return _atomic_write(out_dir, overwrite, fill)
