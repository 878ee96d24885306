"""`k3verify bench --mxfp4`'s logic on CPU (k3-tiny, wall clock): weights memory per mode, parity of the packed
model against the dequantized one before any speed, the MoE-layer / decode / prefill rows and the table.
Speeds mean nothing here; the point is that the GPU run's code paths run in CI."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from k3verify.bench import mxfp4
from k3verify.bench.floor import expert_bytes
from k3verify.bench.mxfp4_run import mxfp4_table, run_mxfp4_bench
from k3verify.cli import main
from k3verify.presets import get_preset

PLAN = mxfp4.Mxfp4Plan("k3-tiny", prefill_lens=(48,), batches=(1, 3), moe_tokens=(1, 5), new_tokens=3,
                       prompt_len=8, parity_len=40, decode_parity_steps=4)


@pytest.fixture(scope="module")
def dry_run() -> dict[str, Any]:
    return run_mxfp4_bench(PLAN, get_preset("k3-tiny"), torch.device("cpu"), 1e10).to_dict()


def test_packed_weights_are_the_checkpoint_bytes(dry_run: dict[str, Any]) -> None:
    """Packed holds codes + scales once; dequantized holds those plus bf16 experts (4 bytes per code byte)."""
    cfg = get_preset("k3-tiny")
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    packed = moe_layers * cfg.num_experts * expert_bytes(cfg, packed=True)
    dense = moe_layers * cfg.num_experts * expert_bytes(cfg, packed=False)
    assert dry_run["memory"]["packed"]["expert_bytes"] == packed
    assert dry_run["memory"]["dequantized"]["expert_bytes"] == packed + dense
    assert dry_run["memory"]["dequantized"]["bf16_expert_bytes"] == dense
    assert dry_run["memory"]["packed"]["bf16_expert_bytes"] == 0
    assert cfg.quant is not None and dense / packed == pytest.approx(4 / (1 + 2 / cfg.quant.group_size))


def test_parity_gates_the_speeds(dry_run: dict[str, Any]) -> None:
    """Prefill and decode logits of the packed model held to the dequantized model (routes pinned, bars from
    its grouped-vs-loop noise), nibble-swapped controls caught, fp32-gold distances recorded; then every
    speed row."""
    assert [p["id"] for p in dry_run["parity"]] == ["bench.mxfp4.prefill_packed_vs_dequantized",
                                                    "bench.mxfp4.decode_packed_vs_dequantized"]
    for p in dry_run["parity"]:
        assert p["status"] == "pass" and p["control_metric"] > p["bar"] > p["metric"], p
        assert p["bar"] == max(4 * p["noise_grouped_vs_loop_rms"], 4 * 2.0**-8), p
        assert p["packed_vs_fp32_gold_rms"] > 0 and p["dequantized_vs_fp32_gold_rms"] > 0, p
        assert "router.flips" in p and "noise_router.pinned" in p, p
    assert dry_run["speeds_reported"]
    assert [r["tokens"] for r in dry_run["moe_layer"]] == [1, 5]
    cfg = get_preset("k3-tiny")
    assert dry_run["moe_layer"][0]["distinct_experts"] == cfg.num_experts_per_token
    assert [r["batch"] for r in dry_run["decode"]] == [1, 3] and [r["tokens"] for r in dry_run["prefill"]] == [48]
    for r in dry_run["decode"]:
        assert r["packed_floor_step_ms"] < r["dequantized_floor_step_ms"] and r["packed_tok_s"] > 0
    assert set(dry_run["build_seconds"]) == {"packed", "dequantized"}
    assert all(set(s) == {"load", "stack", "warmup"} for s in dry_run["build_seconds"].values())


def test_table_rows(dry_run: dict[str, Any]) -> None:
    table = mxfp4_table(dry_run)
    assert "weights memory: experts held" in table and "MoE layer (routed experts), 1 token(s)" in table
    assert "decode batch 3" in table and "prefill 48 tokens" in table and "% of packed floor" in table
    assert "bench.mxfp4.decode_packed_vs_dequantized: pass 0 (bar 0.0156" in table and "Build seconds" in table


def test_parity_bar_is_refused_for_mxfp4(capsys: pytest.CaptureFixture[str]) -> None:
    """Its bars derive from measured noise: a hand-set bar would be ignored, so it is an error."""
    assert main(["bench", "--mxfp4", "--parity-bar", "0.3"]) == 2
    assert "--parity-bar 0.3 does not apply to --mxfp4" in capsys.readouterr().err


def test_dense_presets_are_refused() -> None:
    with pytest.raises(ValueError, match="dense experts"):
        run_mxfp4_bench(mxfp4.Mxfp4Plan("kl-tiny"), get_preset("kl-tiny"), torch.device("cpu"), 1e10)
