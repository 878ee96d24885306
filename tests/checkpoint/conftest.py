"""Shared checkpoint fixtures: one k3-tiny synthetic checkpoint per session, and a way to write damaged copies."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from k3verify.checkpoint.reader import CheckpointReader
from k3verify.checkpoint.synthetic import make_synthetic_checkpoint
from k3verify.checkpoint.writer import write_checkpoint

Tensors = dict[str, torch.Tensor]
Variant = Callable[[str, Callable[[Tensors], None]], Path]


@pytest.fixture(scope="session")
def k3_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean k3-tiny checkpoint (MXFP4 experts, language_model. prefix, vision ignorables, 3 shards)."""
    out = tmp_path_factory.mktemp("ckpt") / "k3-tiny"
    make_synthetic_checkpoint("k3-tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def k3_tiny_tensors(k3_tiny_dir: Path) -> Tensors:
    with CheckpointReader(k3_tiny_dir) as reader:
        return {name: reader[name] for name in reader}


@pytest.fixture
def variant(k3_tiny_dir: Path, k3_tiny_tensors: Tensors, tmp_path: Path) -> Variant:
    """variant(label, edit) -> dir of a k3-tiny copy whose tensors went through `edit` (config kept)."""

    def make(label: str, edit: Callable[[Tensors], None]) -> Path:
        tensors = dict(k3_tiny_tensors)
        edit(tensors)
        out = tmp_path / label
        write_checkpoint(json.loads((k3_tiny_dir / "config.json").read_text()), tensors, out,
                         shard_max_bytes=1 << 20,
                         generation_config=json.loads((k3_tiny_dir / "generation_config.json").read_text()))
        return out

    return make
