"""A NaN or Inf weight is named where it is loaded: the loader's error, `serve`'s refusal and the parity checks
that load it all name the checkpoint tensor, its counts and the first bad index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3verify.checkpoint.loader import WeightLoadError, load_into
from k3verify.checkpoint.synthetic import ensure_preset_checkpoint
from k3verify.cli import build_parser, main
from k3verify.commands import serve
from k3verify.commands.serve_options import ServeOptions
from k3verify.errors import UsageError
from k3verify.serving.model import ServingModel
from k3verify.target import resolve_target

VICTIM = "language_model.model.layers.0.mlp.down_proj.weight"


def nan_copy(tmp_path: Path, value: float = float("nan")) -> Path:
    """k3-tiny with element (1, 2) of one dense weight set to `value`, its shard rewritten."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ensure_preset_checkpoint("k3-tiny"), ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"][VICTIM]
    tensors = load_file(str(shard))
    tensors[VICTIM] = tensors[VICTIM].clone()
    tensors[VICTIM][1, 2] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return ckpt


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_loader_names_a_nonfinite_tensor(tmp_path: Path, value: float) -> None:
    """load_into refuses a NaN / Inf weight with WeightLoadError naming the tensor, the counts and index (1, 2)."""
    target = resolve_target(checkpoint=nan_copy(tmp_path, value))
    model = ServingModel(target.cfg, torch.float32, torch.device("cpu"))
    kind = "1 NaN and 0 Inf" if value != value else "0 NaN and 1 Inf"
    with pytest.raises(WeightLoadError, match=rf"checkpoint tensor {VICTIM} .* holds {kind} value\(s\) of \d+, "
                                              r"the first at index \(1, 2\)"):
        load_into(model, target.cfg, target.weights())


def test_serve_refuses_a_nan_weight_naming_it(tmp_path: Path) -> None:
    """`serve` of a checkpoint holding a NaN weight: a usage error naming the tensor, not a NaN-serving engine."""
    ckpt = nan_copy(tmp_path)
    args = ServeOptions.from_args(build_parser().parse_args(["serve", "--checkpoint", str(ckpt), "--max-batch", "2"]))
    gated = serve.GatedTarget(serve.target_for(args), tmp_path / "report.json")
    with pytest.raises(UsageError, match=f"cannot serve {ckpt}: checkpoint tensor {VICTIM} .* holds 1 NaN"):
        serve.build_engine(args, gated)


def test_parity_stops_at_a_nan_weight_with_exit_2_naming_it_once(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A bad checkpoint is a setup error: the first check that loads the NaN weight stops the run (the second
    selected check never runs), exit 2 naming the tensor once, and the report says verdict error with the reason."""
    ckpt = nan_copy(tmp_path)
    assert main(["parity", "--checkpoint", str(ckpt), "--only", "model.logits.fp32", "--only",
                 "model.layerwise.sublayers", "--report-dir", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert err.count(f"checkpoint tensor {VICTIM}") == 1 and "holds 1 NaN" in err, err
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["results"] == [] and data["summary"]["verdict"] == "error"
    assert f"checkpoint tensor {VICTIM}" in data["summary"]["setup_error"]
