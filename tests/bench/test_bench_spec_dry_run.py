"""The speculative bench's logic on CPU (kl-tiny, wall clock): parity before speed, controlled acceptance, the
per-layer cost rows and the README table. Speeds here mean nothing; the GPU run's code paths run in CI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from k3verify.bench.spec import SpecPlan, run_spec_bench
from k3verify.bench.spec_ref import expected_acceptance
from k3verify.cli import main
from k3verify.presets import get_preset, preset_hf_config


@pytest.fixture(scope="module")
def dry_run() -> Any:
    from k3verify.oracle.hf_kimi_linear import torch_kda_paths

    plan = SpecPlan("kl-tiny", batches=(1, 3), accept=(0.0, 0.8), new_tokens=24, prompt_len=8, parity_len=64,
                    layer_rows=(2,), cost_policy=False)  # the cost policy decides by CPU timings: tested apart
    saved = torch.get_num_threads()  # a module fixture runs before the per-test one-thread fixture
    torch.set_num_threads(1)
    try:
        with torch_kda_paths(torch.device("cpu")):
            return run_spec_bench(plan, get_preset("kl-tiny"), preset_hf_config("kl-tiny"), torch.device("cpu"))
    finally:
        torch.set_num_threads(saved)


def test_spec_bench_gates_then_times_every_batch_and_acceptance(dry_run: Any) -> None:
    """Prefill and score logits parity passed (controls caught) before any row; acceptance follows the drafter."""
    assert [p["id"] for p in dry_run.parity] == ["bench.prefill_logits_vs_fp32_gold",
                                                 "bench.spec_verify_logits_vs_fp32_gold"]
    for parity in dry_run.parity:
        assert parity["status"] == "pass" and parity["control_metric"] > parity["bar"] > parity["metric"], parity
    assert dry_run.speeds_reported
    assert [(r["batch"], r["accept_nominal"]) for r in dry_run.speed] == [(1, 0.0), (1, 0.8), (3, 0.0), (3, 0.8)]
    for r in dry_run.speed:
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["verify_steps"] > 0
        # the decode phase (after the prefill) is timed apart: shorter than the whole call on each side
        whole_ms = {side: 1e3 * r["batch"] * 24 / r[f"{side}_tok_s"] for side in ("plain", "spec")}
        assert 0 < r["plain_decode_ms"] < whole_ms["plain"] and 0 < r["spec_decode_ms"] < whole_ms["spec"], r
        assert r["decode_speedup"] == pytest.approx(r["plain_decode_ms"] / r["spec_decode_ms"])
        assert r["tokens_equal_to_plain"] == 1.0, "on CPU speculative greedy equals plain greedy"
        # so plain's continuation is already the speculative path's own: the first untimed run confirms it
        assert r["ref_converged"] and r["ref_iterations"] == 1 and r["tokens_equal_to_reference"] == 1.0, r
        assert r["accept_expected"] == expected_acceptance(r["accept_nominal"], 4) and "note" not in r, r
    zero = [r for r in dry_run.speed if r["accept_nominal"] == 0.0]
    assert all(r["accept_measured"] == 0.0 and r["turned_off"] == r["batch"] for r in zero), zero
    high = [r for r in dry_run.speed if r["accept_nominal"] == 0.8]
    assert all(r["accept_measured"] > 0.4 and r["turned_off"] == 0 for r in high), high
    (cost,) = dry_run.layer_cost
    assert cost["rows"] == 2 and cost["unfused_us"] > 0 and cost["fused_us"] > 0 and cost["fused_path"] == "torch"


def test_spec_table_renders_from_the_json(dry_run: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(dry_run.to_dict()))
    assert main(["bench", "--table", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| plain decode | speculative | speedup |" in out and "batch 3, k=4, controlled 80%" in out
    assert "KDA layer score" in out and "KDA score path of the speed rows: unfused" in out
    assert "| acceptance measured / expected | drafter reference | tokens equal to reference / plain |" in out
    assert "| converged in 1 | 1.00 / 1.00 |" in out and "NOT converged" not in out
    assert "| decode phase: plain / speculative, speedup |" in out and " ms, " in out


def test_spec_table_says_which_rows_are_not_nominal_and_prints_old_json(dry_run: Any) -> None:
    """A row whose reference did not converge says so in its line and the notes; a row written before the
    reference iteration (no accept_expected / ref_* / tokens_equal_to_reference) still prints."""
    from k3verify.bench.spec import markdown_table

    data = json.loads(json.dumps(dry_run.to_dict()))
    data["speed"][1] |= {"ref_converged": False, "ref_iterations": 12, "note": "did not converge"}
    data["notes"] = ["batch 1 nominal 80%: did not converge"]
    out = markdown_table(data)
    assert "NOT converged in 12: not nominal" in out and "Note: batch 1 nominal 80%: did not converge" in out
    for r in data["speed"]:
        for key in ("accept_expected", "ref_converged", "ref_iterations", "tokens_equal_to_reference", "note",
                    "decode_speedup", "plain_decode_ms", "spec_decode_ms"):
            r.pop(key, None)
    old = markdown_table(data)
    assert old.count("| plain (not iterated) | - / 1.00 |") == len(data["speed"]), old
    assert old.count("| - (older run) |") == len(data["speed"]), old
