"""`k3verify parity` through the real CLI entry point: exit codes 0/1/2 and the reports it writes.
The model side (presets, checkpoint cache, digest) is replaced by fakes so only the engine is tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3verify.cli import main
from k3verify.commands import parity
from k3verify.gates import CheckContext, Kind, Registry, Trial, load_all_checks
from k3verify.gates.report import load_report
from k3verify.presets import get_preset
from k3verify.target import Target

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def fake_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose files are never read (the self-test checks need no model) and stand-in oracle pins."""
    monkeypatch.setattr(parity, "target_for", lambda preset, checkpoint: Target(
        cfg=get_preset("k3-tiny"), name="fake", preset=preset or "k3-tiny", checkpoint_dir=Path("/nonexistent"),
        digest=DIGEST))
    monkeypatch.setattr(parity, "report_pins", lambda: {"fake": True})


def test_unknown_only_pattern_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "--only", "no.such.check*"]) == 2
    assert "--only 'no.such.check*' matches no check" in capsys.readouterr().err


def test_preset_and_checkpoint_together_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["parity", "--preset", "k3-tiny", "--checkpoint", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the no-CUDA error cannot happen")
def test_cuda_without_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bad_device_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "--device", "gpu0"]) == 2
    assert "--device must be cpu or cuda" in capsys.readouterr().err


def test_unknown_preset_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown preset is a usage error naming it and the known ones, before anything is built."""
    assert main(["parity", "--preset", "k3-nope", "--only", "gates.selftest"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'k3-nope'" in err and "k3-tiny" in err


def test_real_shape_preset_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A real shape has no data to check: exit 2 saying how to get a checkpoint instead."""
    assert main(["parity", "--preset", "kimi-linear-48b", "--only", "gates.selftest"]) == 2
    assert "checkpoint make" in capsys.readouterr().err


def test_missing_checkpoint_config_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["parity", "--checkpoint", str(tmp_path), "--only", "gates.selftest"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_list_prints_selected_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "--list", "--only", "gates.selftest"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert {line.split("\t")[0] for line in lines} == {
        "gates.selftest.fp32_sum_order", "gates.selftest.bitexact_pack", "gates.selftest.bf16_linear",
        "gates.selftest.layer_stack"}


def test_green_run_exits_0_and_writes_valid_reports(fake_target: None, tmp_path: Path) -> None:
    out = tmp_path / "rep"
    assert main(["parity", "--only", "gates.selftest", "--seed", "5", "--report-dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "report.html", "report.json"]
    data = load_report(out / "report.json")
    assert data["summary"]["verdict"] == "pass" and data["summary"]["counts"]["pass"] == 4
    run = data["run"]
    assert (run["checkpoint_digest"], run["seed"], run["preset"], run["device"]) == (DIGEST, 5, "k3-tiny", "cpu")
    assert run["only"] == ["gates.selftest"] and run["oracle"] == {"fake": True}


def test_red_run_exits_1(fake_target: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    extra = Registry()

    @extra.register_check(id="kda.t.broken", component="kda", level="module", kind=Kind.BITEXACT,
                          control="negated")
    def broken(ctx: CheckContext) -> Trial:
        r = torch.arange(6)
        return Trial(reference=r, candidate=r.flip(0), control=-r)

    monkeypatch.setattr(parity, "registered_checks", lambda: [*load_all_checks(), *extra])
    out = tmp_path / "rep"
    assert main(["parity", "--only", "gates.selftest", "--only", "kda.t", "--report-dir", str(out)]) == 1
    data = json.loads((out / "report.json").read_text())
    assert data["summary"]["verdict"] == "fail"
    assert {r["id"]: r["status"] for r in data["results"]}["kda.t.broken"] == "fail"
