"""`k3verify checkpoint reconcile DIR --tp N --ep M`: every rank's slices checked against the shard headers; a
tensor stored transposed is named per rank."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from k3verify.checkpoint.reader import CheckpointReader
from k3verify.cli import main
from k3verify.target import resolve_target

NAME = "model.layers.1.self_attn.o_proj.weight"


def test_reconcile_names_a_transposed_tensor_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = resolve_target("kl-tiny").checkpoint_dir
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    assert main(["checkpoint", "reconcile", str(ckpt), "--tp", "2", "--ep", "2"]) == 0
    assert "per-rank slices (tp=2 ep=2 (world 2)): ok" in capsys.readouterr().out
    shard = ckpt / CheckpointReader(ckpt).entries[NAME].file
    tensors = load_file(shard)
    tensors[NAME] = tensors[NAME].t().contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    assert main(["checkpoint", "reconcile", str(ckpt), "--tp", "2", "--ep", "2"]) == 1
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"rank {rank}: parameter {NAME} <- {NAME}[" in out
    assert f"{NAME} is stored transposed: stored [32, 64], the model expects [64, 32]" in out
