"""The long-context gate check of the full suite passes on k3-tiny and kl-tiny through the served path (past 64
pages, four prefill segments, several hundred tokens on one expert in one segment), and its control (a page index
taken modulo 64) is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3verify.cli import main


@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_long_context_check_passes_and_catches_its_control(preset: str, tmp_path: Path) -> None:
    rc = main(["parity", "--preset", preset, "--suite", "full", "--only", "serving.long_context.logits",
               "--report-dir", str(tmp_path)])
    (result,) = json.loads((tmp_path / "report.json").read_text())["results"]
    assert rc == 0 and result["status"] == "pass", result.get("reason")
    assert result["control"]["status"] == "fail"
    metrics = result["metrics"]
    assert metrics["pages"] > 64 and metrics["prefill_segments"] >= 3 and metrics["tokens"] >= 4000
    assert metrics["max_tokens_one_expert_one_segment"] >= 300
