"""One way from what the user named (a preset or a checkpoint directory) to what every command works on.

`resolve_target` is used by parity, serve and mutate, and through `resolve_shape` by bench: the config always
comes from the checkpoint's own
config.json + generation_config.json (`ModelConfig.from_file`), so every command sees the same eos ids; a synthetic
preset is first written once to the checkpoint cache, so a preset and a checkpoint travel the same road. A directory
written by transformers (its tensor spellings, every one of them placed by checkpoint/hf_interop.py) is read
through that name map and says so (`Target.names`). Every problem is a `TargetError` naming the value; commands
turn it into exit code 2. The one exception: `resolve_shape` (bench, which generates its own name-seeded weights
on the GPU) also takes the real-shape presets (kl-48b-8l, k3-slice-4l, ...), whose config comes from the preset
table because there is no data to write.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3verify.checkpoint.digest import checkpoint_digest
from k3verify.checkpoint.hf_interop import normalize_hf_names, uses_transformers_names
from k3verify.checkpoint.reader import CheckpointError, CheckpointReader
from k3verify.checkpoint.snapshot import CheckpointSnapshot
from k3verify.checkpoint.synthetic import ensure_preset_checkpoint
from k3verify.config import ModelConfig
from k3verify.presets import PRESETS, SYNTHETIC_PRESETS, get_preset, preset_hf_config
from k3verify.tokenizer import KimiTokenizer
from k3verify.tokenizer.tokenizer import CONFIG_FILE, MODEL_FILE

DEFAULT_PRESET = "k3-tiny"
DEFAULT_REPORT_DIR = Path("reports/latest")
# The dtypes a served model runs in: what parity gates and what serve may serve (a report names one of them).
SERVING_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class TargetError(ValueError):
    """The named preset or checkpoint cannot be used; the message names the value and why."""


@dataclass(frozen=True)
class Target:
    """A model to check or serve: its parsed config, where its files are, and the digest reports carry."""

    cfg: ModelConfig
    name: str  # the preset name, or the checkpoint directory's name
    preset: str | None
    checkpoint_dir: Path
    digest: str
    names: str = "published"  # "transformers": the dir uses transformers' tensor spellings (hf_interop maps them)

    def hf_config(self) -> dict[str, Any]:
        """The config.json dict as written (transformers' model is built from it)."""
        result: dict[str, Any] = json.loads((self.checkpoint_dir / "config.json").read_text(encoding="utf-8"))
        return result

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The checkpoint's tensors by our checkpoint names, read lazily: the one source of weights for every
        stack (a transformers-written dir is seen through hf_interop's name map, which places every name)."""
        reader = CheckpointReader(self.checkpoint_dir)
        return normalize_hf_names(self.cfg, reader) if self.names == "transformers" else reader

    def tokenizer(self) -> KimiTokenizer:
        """The checkpoint's own tokenizer (a checkpoint must ship its tokenizer files)."""
        try:
            return KimiTokenizer.from_dir(self.checkpoint_dir)
        except (OSError, ValueError) as exc:
            raise TargetError(f"{self.checkpoint_dir}: its tokenizer cannot be loaded ({exc}); a checkpoint must "
                              "ship its own tokenizer files") from exc

    def tokenizer_bytes(self) -> TokenizerBytes:
        """The tokenizer's two files, read once: what an HTTP process builds the same tokenizer from (never the
        directory again). `serve` takes them from its snapshot instead (ServedCheckpoint)."""
        try:
            return TokenizerBytes((self.checkpoint_dir / MODEL_FILE).read_bytes(),
                                  (self.checkpoint_dir / CONFIG_FILE).read_bytes(), str(self.checkpoint_dir))
        except OSError as exc:
            raise TargetError(f"{self.checkpoint_dir}: its tokenizer cannot be loaded ({exc}); a checkpoint must "
                              "ship its own tokenizer files") from exc

    def source_flag(self) -> str:
        """The command-line words that name this target again (`--preset k3-tiny`, `--checkpoint DIR`)."""
        return f"--preset {self.preset}" if self.preset is not None else f"--checkpoint {self.checkpoint_dir}"


def resolve_target(preset: str | None = None, checkpoint: str | Path | None = None) -> Target:
    """A Target from a synthetic preset (written to the checkpoint cache on first use) or a checkpoint dir;
    with neither, the default preset."""
    if preset is not None and checkpoint is not None:
        raise TargetError("give a preset or a checkpoint, not both")
    if checkpoint is not None:
        return _from_dir(Path(checkpoint), preset=None, name=Path(checkpoint).resolve().name)
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise TargetError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    if name not in SYNTHETIC_PRESETS:
        raise TargetError(f"preset {name!r} is a real shape with no data; write it with `k3verify checkpoint make` "
                          f"and pass --checkpoint, or use a synthetic preset: {', '.join(SYNTHETIC_PRESETS)}")
    return _from_dir(ensure_preset_checkpoint(name), preset=name, name=name)


def _from_dir(ckpt: Path, *, preset: str | None, name: str) -> Target:
    config_path = ckpt / "config.json"
    if not config_path.is_file():
        raise TargetError(f"{ckpt}: no config.json there")
    try:
        cfg = ModelConfig.from_file(config_path)
    except (ValueError, KeyError, TypeError) as exc:
        raise TargetError(f"{config_path}: {exc}") from exc
    try:
        digest = checkpoint_digest(ckpt)
    except (CheckpointError, OSError) as exc:
        raise TargetError(f"{ckpt}: cannot digest the checkpoint: {exc}") from exc
    try:  # every shard header against its file: a truncated shard is a setup error, as a missing one is
        with CheckpointReader(ckpt) as reader:
            names = list(reader)
    except (CheckpointError, OSError) as exc:
        raise TargetError(f"the checkpoint cannot be read: {exc}") from exc
    spelling = "transformers" if uses_transformers_names(cfg, names) else "published"
    return Target(cfg, name, preset, ckpt, digest, spelling)


@dataclass(frozen=True)
class TokenizerBytes:
    """A tokenizer's two files as bytes (picklable): what the HTTP process builds its tokenizer from."""

    model: bytes
    config: bytes
    source: str  # the checkpoint directory, for messages

    def load(self) -> KimiTokenizer:
        return KimiTokenizer.from_bytes(self.model, self.config, f"{self.source}/{MODEL_FILE}",
                                        f"{self.source}/{CONFIG_FILE}")


@dataclass(frozen=True)
class ServedCheckpoint:
    """A target whose config, digest, weights and tokenizer all come from one snapshot of its directory
    (checkpoint/snapshot.py): what `serve` loads is what its digest covered, and nothing is read again by path."""

    target: Target
    snapshot: CheckpointSnapshot

    def weights(self) -> Mapping[str, torch.Tensor]:
        tensors = self.snapshot.tensors()
        return normalize_hf_names(self.target.cfg, tensors) if self.target.names == "transformers" else tensors

    def tokenizer_bytes(self) -> TokenizerBytes:
        try:
            return TokenizerBytes(self.snapshot.data(MODEL_FILE), self.snapshot.data(CONFIG_FILE),
                                  str(self.target.checkpoint_dir))
        except KeyError as exc:
            raise TargetError(f"{self.target.checkpoint_dir}: its tokenizer cannot be loaded ({exc.args[0]}); a "
                              "checkpoint must ship its own tokenizer files") from None

    def tokenizer(self) -> KimiTokenizer:
        files = self.tokenizer_bytes()
        try:
            return files.load()
        except ValueError as exc:
            raise TargetError(f"{self.target.checkpoint_dir}: its tokenizer cannot be loaded ({exc}); a checkpoint "
                              "must ship its own tokenizer files") from exc


def snapshot_target(target: Target) -> ServedCheckpoint:
    """`target` read again as one snapshot: its digest (of the bytes read now), config and tensor names from those
    bytes; TargetError naming the file for anything missing or unreadable."""
    ckpt = target.checkpoint_dir
    try:
        snap = CheckpointSnapshot.read(ckpt)
        cfg = ModelConfig.from_bytes(snap.data("config.json"), snap.files.get("generation_config.json"),
                                     ckpt / "config.json")
    except (CheckpointError, OSError) as exc:
        raise TargetError(f"{ckpt}: cannot read the checkpoint: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise TargetError(f"{ckpt / 'config.json'}: {exc}") from exc
    spelling = "transformers" if uses_transformers_names(cfg, list(snap.entries)) else "published"
    return ServedCheckpoint(Target(cfg, target.name, target.preset, ckpt, snap.digest, spelling), snap)


@dataclass(frozen=True)
class ModelShape:
    """What a command that makes its own weights needs (bench): the config, the config.json dict a transformers
    baseline is built from, and the name results carry."""

    cfg: ModelConfig
    hf_dict: dict[str, Any]
    name: str
    preset: str | None
    checkpoint_dir: Path | None  # the directory the user named (its weights are not read); None for a preset


def resolve_shape(preset: str | None = None, checkpoint: str | Path | None = None) -> ModelShape:
    """The shape of a preset or a checkpoint directory. A real-shape preset is read from the preset table (nothing
    is written: its weights would be gigabytes); a synthetic preset and a checkpoint go through resolve_target, so
    their config parsing and eos ids are the ones parity and serve see."""
    if checkpoint is None and preset in PRESETS and preset not in SYNTHETIC_PRESETS:
        return ModelShape(get_preset(preset), preset_hf_config(preset), preset, preset, None)
    target = resolve_target(preset, checkpoint)
    return ModelShape(target.cfg, target.hf_config(), target.name, target.preset,
                      None if target.preset is not None else target.checkpoint_dir)
