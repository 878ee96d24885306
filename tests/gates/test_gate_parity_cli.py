"""`k3verify parity` through the real CLI entry point: exit codes 0/1/2 and the reports it writes.
The model side (presets, checkpoint cache, digest) is replaced by fakes so only the engine is tested."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from k3verify.cli import main
from k3verify.commands import parity
from k3verify.gates import CheckContext, Kind, Registry, Trial, load_all_checks
from k3verify.gates.report.json_report import load_report
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


def test_unknown_preset_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An unknown preset is a usage error naming it and the known ones, before anything is built."""
    assert main(["parity", "--preset", "k3-nope", "--only", "gates.selftest", "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'k3-nope'" in err and "k3-tiny" in err


def test_real_shape_preset_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A real shape has no data to check: exit 2 saying how to get a checkpoint instead."""
    assert main(["parity", "--preset", "kimi-linear-48b", "--only", "gates.selftest", "--report-dir",
                 str(tmp_path)]) == 2
    assert "checkpoint make" in capsys.readouterr().err


def test_missing_checkpoint_config_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["parity", "--checkpoint", str(tmp_path), "--only", "gates.selftest", "--report-dir",
                 str(tmp_path / "reports")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_list_prints_selected_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parity", "--list", "--only", "gates.selftest"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert {line.split("\t")[0] for line in lines} == {
        "gates.selftest.fp32_sum_order", "gates.selftest.bitexact_pack", "gates.selftest.bf16_linear",
        "gates.selftest.layer_stack"}
    bars = {line.split("\t")[0]: line.split("\t")[4] for line in lines}  # a derived bar has no fixed value
    assert bars["gates.selftest.fp32_sum_order"] == "noise" and bars["gates.selftest.bitexact_pack"] == "-"


def test_green_run_exits_0_and_writes_valid_reports(fake_target: None, tmp_path: Path) -> None:
    out = tmp_path / "rep"
    assert main(["parity", "--only", "gates.selftest", "--seed", "5", "--report-dir", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "report-index.jsonl", "report.html", "report.json"]
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


def _damaged_copy(tmp_path: Path) -> Path:
    from k3verify.checkpoint.synthetic import ensure_preset_checkpoint

    copy = tmp_path / "ckpt"
    shutil.copytree(ensure_preset_checkpoint("k3-tiny"), copy)
    return copy


@pytest.mark.parametrize("damage", ["missing shard", "unreadable shard", "truncated shard", "bad config",
                                    "config not json"])
def test_setup_error_exits_2_naming_the_file_and_writes_an_error_report(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged checkpoint (a truncated shard as much as a missing one) is exit 2 (not a traceback, nor exit 1 with
    every check erroring) with a message naming the file, and report.json records verdict "error" with it."""
    ckpt = _damaged_copy(tmp_path)
    shard = ckpt / "model-00002-of-00003.safetensors"
    victim = {"missing shard": shard, "unreadable shard": shard, "truncated shard": shard,
              "bad config": ckpt / "config.json", "config not json": ckpt / "config.json"}[damage]
    if damage == "truncated shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif damage in ("missing shard", "unreadable shard"):
        shard.unlink()
        if damage == "unreadable shard":
            shard.mkdir()  # unreadable even for root
    elif damage == "bad config":
        cfg = json.loads(victim.read_text())
        victim.write_text(json.dumps(cfg | {"frobnication_factor": 3}))
    else:
        victim.write_text("{ not json")
    out = tmp_path / "rep"
    assert main(["parity", "--checkpoint", str(ckpt), "--report-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(victim) in err and "Traceback" not in err
    data = load_report(out / "report.json")
    assert data["summary"]["verdict"] == "error" and str(victim) in data["summary"]["setup_error"]
    assert data["run"]["checkpoint"] == str(ckpt) and data["results"] == []


def test_report_key_signs_the_report(fake_target: None, tmp_path: Path) -> None:
    """--report-key FILE: report.json carries an HMAC that verifies with that key."""
    from k3verify.gates.core.binding import signature_problem

    key = tmp_path / "k"
    key.write_text("a-key-of-enough-bytes\n")
    out = tmp_path / "rep"
    assert main(["parity", "--only", "gates.selftest", "--report-dir", str(out), "--report-key", str(key)]) == 0
    assert signature_problem(load_report(out), b"a-key-of-enough-bytes") is None


def test_a_report_dir_that_cannot_be_written_is_exit_2_before_any_check_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--report-dir under a regular file: exit 2 naming the directory, found before the suite (which never runs)."""
    def no_suite(*args: object, **kw: object) -> None:
        raise AssertionError("the suite ran before the report dir was found unwritable")

    monkeypatch.setattr(parity, "run_suite", no_suite)
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "reports"
    assert main(["parity", "--only", "gates.selftest", "--report-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--report-dir: cannot write reports into {out}: Not a directory; nothing was run" in err, err
    assert "Traceback" not in err
