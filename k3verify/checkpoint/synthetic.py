"""Synthetic checkpoints of the presets, written once and cached.

`make_synthetic_checkpoint` writes a preset's config.json, generation_config.json, name-seeded weights
(`synthetic_weights`, MXFP4 experts packed) shard by shard — small shards for the synthetic presets (so even
the tiny ones exercise the index), 4 GiB shards for real shapes — and the project's tokenizer assets (widened
to the real id layout for real shapes). `ensure_preset_checkpoint` keeps one copy per
(preset, seed, code version) in a cache dir and rebuilds it when its completion marker is missing,
stale or the shards no longer match their headers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from k3verify.checkpoint.names import checkpoint_specs
from k3verify.checkpoint.reader import CheckpointError, CheckpointReader
from k3verify.checkpoint.synthetic_weights import synthetic_group
from k3verify.checkpoint.writer import (
    WrittenCheckpoint,
    gc_paused,
    stable_json,
    write_sparse_checkpoint,
    write_streamed_checkpoint,
)
from k3verify.config import ModelConfig
from k3verify.presets import (
    PRESETS,
    SYN_BOS,
    SYNTHETIC_PRESETS,
    get_preset,
    preset_generation_config,
    preset_hf_config,
)
from k3verify.tokenizer.widened import write_widened_tokenizer

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")

SYNTHETIC_SHARD_MAX_BYTES = 1 << 20  # 1 MiB: every synthetic preset (>= 1.7 MiB) gets at least two shards
REAL_SHARD_MAX_BYTES = 4 << 30  # real shapes with data: a 27.7 GB kl-48b-8l in 7 shards
SPARSE_SHARD_MAX_BYTES = 50 << 30  # real-shape sparse fixtures: ~30 shards for K3, like a real release
TOKENIZER_ASSETS = Path(__file__).resolve().parents[1] / "tokenizer" / "assets"
TOKENIZER_REQUIRED = ("tiktoken.model", "tokenizer_config.json")
MARKER_FILE = ".k3verify-complete.json"
CACHE_ENV = "K3V_CACHE_DIR"

# Sources whose change changes the bytes of a synthetic checkpoint (the cache key's code version).
_PACKAGE = Path(__file__).resolve().parents[1]
_CODE_FILES = ("config.py", "config_json.py", "presets.py", "checkpoint/names.py", "checkpoint/synthetic_weights.py",
               "checkpoint/mxfp4.py", "checkpoint/writer.py", "checkpoint/synthetic.py", "tokenizer/widened.py")


def code_version() -> str:
    """12 hex digits over the sources that decide the checkpoint bytes and the tokenizer assets."""
    h = hashlib.sha256()
    files = [_PACKAGE / rel for rel in _CODE_FILES] + _asset_files()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _asset_files() -> list[Path]:
    if not TOKENIZER_ASSETS.is_dir():
        return []
    return sorted(p for p in TOKENIZER_ASSETS.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix != ".py")


def _tokenizer_dir() -> Path | None:
    """The assets folder, or None with a warning while it lacks the tokenizer files."""
    present = {p.name for p in _asset_files()}
    missing = [name for name in TOKENIZER_REQUIRED if name not in present]
    if not present:
        log.warning("%s has no tokenizer assets yet; the synthetic checkpoint is written without a tokenizer",
                    TOKENIZER_ASSETS)
        return None
    if missing:
        log.warning("%s lacks %s; copying only %s", TOKENIZER_ASSETS, missing, sorted(present))
    return TOKENIZER_ASSETS


def _check_synthetic(preset_name: str) -> None:
    if preset_name not in PRESETS:
        raise KeyError(f"unknown preset {preset_name!r}; known: {', '.join(PRESETS)}")
    if preset_name not in SYNTHETIC_PRESETS:
        raise ValueError(f"preset {preset_name!r} is a real shape and cannot be materialised; synthetic presets: "
                         f"{', '.join(SYNTHETIC_PRESETS)} (a real shape can be written sparse, without data)")


def make_synthetic_checkpoint(preset_name: str, out_dir: str | Path, seed: int = 0, *, overwrite: bool = False,
                              device: torch.device | str = "cpu",
                              on_shard: Callable[[str, int], None] | None = None) -> WrittenCheckpoint:
    """Write preset `preset_name` (any preset, real shapes too) with weights seeded by `seed` into `out_dir`,
    shard by shard: memory holds one shard. Deterministic bytes for a given (preset, seed, device kind): the
    values come from `device`'s generator (a CUDA build is fast at real size and differs from the CPU build)."""
    if preset_name not in PRESETS:
        raise KeyError(f"unknown preset {preset_name!r}; known: {', '.join(PRESETS)}")
    return _write_synthetic(preset_name, Path(out_dir), seed, overwrite, None, torch.device(device), on_shard)


def _write_synthetic(preset_name: str, out_dir: Path, seed: int, overwrite: bool, marker: dict[str, str] | None,
                     device: torch.device = _CPU, on_shard: Callable[[str, int], None] | None = None
                     ) -> WrittenCheckpoint:
    cfg = get_preset(preset_name)
    with gc_paused():
        specs = checkpoint_specs(cfg)
    layout = {name: (spec.shape, spec.dtype) for name, spec in specs.items()}

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: t.to("cpu") for n, t in synthetic_group(cfg, specs, names, seed, device).items()}

    shard_max = SYNTHETIC_SHARD_MAX_BYTES if preset_name in SYNTHETIC_PRESETS else REAL_SHARD_MAX_BYTES
    return write_streamed_checkpoint(
        preset_hf_config(preset_name), layout, produce, out_dir, shard_max_bytes=shard_max,
        generation_config=preset_generation_config(preset_name), tokenizer=_tokenizer_writer(cfg),
        overwrite=overwrite, extra_files={MARKER_FILE: stable_json(marker)} if marker else None, on_shard=on_shard)


def _tokenizer_writer(cfg: ModelConfig) -> Callable[[Path], None] | None:
    """The project's tokenizer, widened to the config's id layout when its specials sit elsewhere (real shapes:
    [BOS] at 163584 = the base vocabulary size)."""
    assets = _tokenizer_dir()
    if assets is None or cfg.bos_token_id == SYN_BOS:
        return None if assets is None else (lambda tmp: _copy_assets(assets, tmp))
    return lambda tmp: write_widened_tokenizer(tmp, cfg.bos_token_id)


def _copy_assets(assets: Path, tmp: Path) -> None:
    for path in sorted(assets.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.suffix != ".py":
            shutil.copyfile(path, tmp / path.name)


def make_sparse_checkpoint(preset_name: str, out_dir: str | Path, *, overwrite: bool = False,
                           shard_max_bytes: int = SPARSE_SHARD_MAX_BYTES) -> WrittenCheckpoint:
    """Any preset (real shapes included) with exact names/shapes/dtypes and all-zero sparse data."""
    with gc_paused():
        specs = {name: (spec.shape, spec.dtype) for name, spec in checkpoint_specs(get_preset(preset_name)).items()}
    return write_sparse_checkpoint(preset_hf_config(preset_name), specs, out_dir, shard_max_bytes=shard_max_bytes,
                                   generation_config=preset_generation_config(preset_name), overwrite=overwrite)


def default_cache_root() -> Path:
    """`$K3V_CACHE_DIR/checkpoints`, else `~/.cache/k3verify/checkpoints`."""
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "k3verify"
    return root / "checkpoints"


def preset_cache_dir(name: str, seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / f"{name}-s{seed}-{code_version()}"


def _is_complete(path: Path, marker: dict[str, str]) -> bool:
    try:
        found = json.loads((path / MARKER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if found != marker:
        return False
    try:
        CheckpointReader(path)  # every shard present, every header parses, file sizes match
    except CheckpointError as exc:
        log.warning("cached checkpoint %s is damaged (%s); rebuilding", path, exc)
        return False
    return True


def ensure_preset_checkpoint(name: str, seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """The cached synthetic checkpoint of preset `name`, built on first use."""
    _check_synthetic(name)
    path = preset_cache_dir(name, seed, cache_dir)
    marker = {"preset": name, "seed": str(seed), "code_version": code_version()}
    if _is_complete(path, marker):
        return path
    if path.exists():
        log.warning("cached checkpoint %s is incomplete or stale; rebuilding", path)
        shutil.rmtree(path)
    try:
        _write_synthetic(name, path, seed, False, marker)
    except FileExistsError:
        if not _is_complete(path, marker):  # another process won the rename: its copy must be whole
            raise
    return path
