"""`k3verify bench --mxfp4`'s logic on CPU (k3-tiny, wall clock): weights memory per mode, parity against the
fp32 gold before any speed, the MoE-layer / decode / prefill rows and the table. Speeds mean nothing here;
the point is that the GPU run's code paths run in CI."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from k3verify.bench import mxfp4
from k3verify.bench.floor import expert_bytes
from k3verify.bench.mxfp4_run import mxfp4_table, run_mxfp4_bench
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
    """Prefill and decode logits of the packed model within 1.5x the dequantized model's distance to the
    fp32 gold, their controls (nibbles swapped, stale KDA state) caught; then every speed row."""
    assert [p["id"] for p in dry_run["parity"]] == ["bench.mxfp4.prefill_logits_vs_fp32_gold",
                                                    "bench.mxfp4.decode_logits_vs_fp32_gold"]
    for p in dry_run["parity"]:
        assert p["status"] == "pass" and p["control_metric"] > p["bar"] > p["metric"], p
    assert dry_run["speeds_reported"]
    assert [r["tokens"] for r in dry_run["moe_layer"]] == [1, 5]
    cfg = get_preset("k3-tiny")
    assert dry_run["moe_layer"][0]["distinct_experts"] == cfg.num_experts_per_token
    assert [r["batch"] for r in dry_run["decode"]] == [1, 3] and [r["tokens"] for r in dry_run["prefill"]] == [48]
    for r in dry_run["decode"]:
        assert r["packed_floor_step_ms"] < r["dequantized_floor_step_ms"] and r["packed_tok_s"] > 0


def test_table_rows(dry_run: dict[str, Any]) -> None:
    table = mxfp4_table(dry_run)
    assert "weights memory: experts held" in table and "MoE layer (routed experts), 1 token(s)" in table
    assert "decode batch 3" in table and "prefill 48 tokens" in table and "% of packed floor" in table


def test_dense_presets_are_refused() -> None:
    with pytest.raises(ValueError, match="dense experts"):
        run_mxfp4_bench(mxfp4.Mxfp4Plan("kl-tiny"), get_preset("kl-tiny"), torch.device("cpu"), 1e10)
