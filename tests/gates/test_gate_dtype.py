"""`parity --dtype` runs the served-model checks in that dtype and the report records the dtypes covered;
`serve --dtype` builds its model in the dtype asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3verify.cli import build_parser, main
from k3verify.commands import serve
from k3verify.commands.serve_options import ServeOptions
from k3verify.gates.report.json_report import load_report


def _parity(tmp_path: Path, *argv: str) -> dict:
    assert main(["parity", "--preset", "kl-tiny", "--report-dir", str(tmp_path), *argv]) == 0
    return load_report(tmp_path / "report.json")


def test_served_model_check_runs_in_the_requested_dtype_and_the_run_records_it(tmp_path: Path) -> None:
    """served.vs_gold alone: the dtypes covered are exactly the one asked for, default bfloat16."""
    bf16 = _parity(tmp_path / "bf16", "--only", "served.vs_gold")
    fp32 = _parity(tmp_path / "fp32", "--only", "served.vs_gold", "--dtype", "float32")
    assert bf16["run"]["dtypes"] == ["bfloat16"] and fp32["run"]["dtypes"] == ["float32"]
    [r16], [r32] = bf16["results"], fp32["results"]
    assert r16["status"] == r32["status"] == "pass"
    assert r16["metrics"]["decode.baseline_vs_gold"] > 100 * max(r32["metrics"]["decode.baseline_vs_gold"], 1e-6)
    assert "serving dtype bfloat16" in r16["notes"][0] and "serving dtype float32" in r32["notes"][0]


def test_module_level_use_of_a_dtype_is_not_coverage(tmp_path: Path) -> None:
    """A module check's bf16 model is not the served model: only model/serving-level checks count."""
    report = _parity(tmp_path, "--suite", "full", "--only", "mlp.module.bf16", "--only", "serving.decode.vs_full")
    assert report["run"]["dtypes"] == ["float32"]


def test_serve_builds_the_model_in_the_requested_dtype(tmp_path: Path) -> None:
    args = ServeOptions.from_args(build_parser().parse_args(["serve", "--preset", "k3-tiny", "--dtype", "float32",
                                                            "--max-batch", "2"]))
    engine, _ = serve.build_engine(args, serve.GatedTarget(serve.target_for(args), tmp_path / "report.json"))
    assert engine.runner.model.dtype == torch.float32
    assert serve.parity_command(args).endswith(f"--dtype float32 --report-dir {args.report_dir}")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float16"])


def test_an_fp64_instrument_model_is_not_coverage() -> None:
    """A serving-level check may build an fp64 serving model as an instrument: that is no dtype `serve` runs."""
    from k3verify.gates import CheckContext
    from k3verify.gates.shared import builders
    from k3verify.target import resolve_target

    ctx = CheckContext(resolve_target("kl-tiny"), torch.device("cpu"), 0, torch.Generator(), "quick", {},
                       level="serving")
    builders.serving_model(ctx, torch.float64)
    builders.serving_model(ctx, torch.float32)
    assert sorted(ctx.serving_dtypes) == ["float32"]
