"""`k3verify bench` resolves its model through k3verify/target.py (CPU: the resolution, and the hand-off of the
resolved shape to run_bench with the GPU parts replaced)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from k3verify import target as target_mod
from k3verify.bench import run as bench_run
from k3verify.cli import main
from k3verify.commands import bench as bench_cmd
from k3verify.errors import UsageError
from k3verify.presets import get_preset, preset_hf_config
from k3verify.target import TargetError, resolve_shape, resolve_target


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"preset": None, "checkpoint": None, "mxfp4": False, **kw})


def test_real_shape_preset_comes_from_the_table_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str, *a: object, **k: object) -> Path:
        raise AssertionError(f"a real-shape preset must not be written to the cache ({name})")
    monkeypatch.setattr(target_mod, "ensure_preset_checkpoint", refuse)
    shape = resolve_shape("kl-48b-8l")
    assert shape.cfg == get_preset("kl-48b-8l") and shape.hf_dict == preset_hf_config("kl-48b-8l")
    assert (shape.name, shape.preset, shape.checkpoint_dir) == ("kl-48b-8l", "kl-48b-8l", None)


def test_synthetic_preset_and_checkpoint_take_resolve_targets_road() -> None:
    target = resolve_target("kl-tiny")
    shape = resolve_shape("kl-tiny")
    assert shape.cfg == target.cfg and shape.hf_dict == target.hf_config() and shape.checkpoint_dir is None
    from_dir = resolve_shape(checkpoint=target.checkpoint_dir)
    assert from_dir.cfg == target.cfg and from_dir.preset is None
    assert from_dir.checkpoint_dir == target.checkpoint_dir and from_dir.name == target.checkpoint_dir.resolve().name


@pytest.mark.parametrize(("preset", "checkpoint", "words"), [
    ("kl-nope", None, "unknown preset 'kl-nope'"),
    ("kl-tiny", "/nonexistent", "not both"),
    (None, "/nonexistent/ckpt", "/nonexistent/ckpt: no config.json"),
])
def test_resolution_errors_name_the_value(preset: str | None, checkpoint: str | None, words: str) -> None:
    with pytest.raises(TargetError, match=words):
        resolve_shape(preset, checkpoint)


def test_bench_defaults_per_mode_and_no_default_beside_a_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str | None, object]] = []

    def fake(preset: str | None, checkpoint: object) -> object:
        seen.append((preset, checkpoint))
        return "shape"
    monkeypatch.setattr(bench_cmd, "resolve_shape", fake)
    bench_cmd.bench_shape(_args())
    bench_cmd.bench_shape(_args(mxfp4=True))
    bench_cmd.bench_shape(_args(checkpoint=Path("/x")))
    bench_cmd.bench_shape(_args(preset="kl-tiny", mxfp4=True))
    assert seen == [("kl-48b-8l", None), ("k3-slice-4l", None), (None, Path("/x")), ("kl-tiny", None)]


def test_bench_cli_reports_a_bad_name_before_the_cuda_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--preset", "kl-nope"]) == 2
    assert "--preset kl-nope: unknown preset 'kl-nope'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--checkpoint /nonexistent/ckpt: /nonexistent/ckpt: no config.json"):
        bench_cmd.bench_shape(_args(checkpoint=Path("/nonexistent/ckpt")))


def test_run_hands_the_resolved_shape_to_run_bench(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU parts replaced: what run_bench receives is the resolver's cfg / config.json dict / name, and a
    checkpoint's run says its weights were generated, not read."""
    ckpt = resolve_target("kl-tiny").checkpoint_dir
    calls: list[tuple[Any, ...]] = []

    def fake_run_bench(plan: bench_run.BenchPlan, cfg: Any, hf_dict: Any, device: torch.device,
                       bandwidth: float) -> bench_run.BenchResult:
        calls.append((plan.preset, cfg, hf_dict, device.type))
        return bench_run.BenchResult(plan.preset, "fake", bandwidth / 1e9, speeds_reported=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_run, "run_bench", fake_run_bench)
    monkeypatch.setattr(bench_run, "measure_bandwidth", lambda: 1e12)
    assert main(["bench", "--checkpoint", str(ckpt), "--prefill", "32", "--batch", "1"]) == 0
    want = resolve_shape(checkpoint=ckpt)
    assert calls == [(want.name, want.cfg, want.hf_dict, "cuda")]
    out = capsys.readouterr().out
    assert "not read from the checkpoint" in out and f"{ckpt}/config.json" in out
