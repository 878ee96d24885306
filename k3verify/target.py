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

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3verify.checkpoint.digest import checkpoint_digest
from k3verify.checkpoint.hf_interop import normalize_hf_names, uses_transformers_names
from k3verify.checkpoint.reader import CheckpointError, CheckpointReader, read_index
from k3verify.checkpoint.synthetic import ensure_preset_checkpoint
from k3verify.config import ModelConfig
from k3verify.presets import PRESETS, SYNTHETIC_PRESETS, get_preset, preset_hf_config
from k3verify.tokenizer import KimiTokenizer

DEFAULT_PRESET = "k3-tiny"
DEFAULT_REPORT_DIR = Path("reports/latest")


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

    def tokenizer_loader(self) -> Callable[[], KimiTokenizer]:
        """A picklable callable that loads the tokenizer again (in the HTTP server's own process)."""
        return functools.partial(KimiTokenizer.from_dir, self.checkpoint_dir)

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
        names = list(read_index(ckpt).weight_map)
    except (CheckpointError, OSError) as exc:
        raise TargetError(f"{ckpt}: cannot digest the checkpoint: {exc}") from exc
    spelling = "transformers" if uses_transformers_names(cfg, names) else "published"
    return Target(cfg, name, preset, ckpt, digest, spelling)


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
