"""What real checkpoints carry is accepted by named rules, reported, and nothing else is loosened."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3verify.checkpoint.buckets import reconcile_checkpoint
from k3verify.checkpoint.loader import WeightLoadError
from k3verify.checkpoint.reader import CheckpointReader
from k3verify.cli import main
from k3verify.config import ModelConfig
from k3verify.serving.batch import PackedBatch
from k3verify.serving.model import ServingModel

P = "language_model."
ROUTER = f"{P}model.layers.1.block_sparse_moe.gate.weight"
A_LOG = f"{P}model.layers.0.self_attn.A_log"  # k3-tiny: 3 KDA heads, head dim 16, stored width 4
HEADS, HEAD_DIM = 3, 16


def _routers_fp32(t: dict[str, torch.Tensor]) -> None:
    for name in [n for n in t if n.endswith("block_sparse_moe.gate.weight")]:
        t[name] = t[name].float()


def _a_log_to(length: int, pad: float = -7.0) -> object:
    def edit(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.endswith("self_attn.A_log")]:
            out = torch.full((length,), pad)
            out[:min(length, HEADS)] = t[name][:min(length, HEADS)]
            t[name] = out
    return edit


def _logits(ckpt: Path) -> torch.Tensor:
    cfg = ModelConfig.from_file(ckpt)
    model = ServingModel(cfg, torch.float32).load(CheckpointReader(ckpt))
    ids = torch.arange(5, 29) * 37 % cfg.vocab_size
    return model.prefill(PackedBatch.build(ids, [ids.numel()]), all_logits=True).all_logits


def test_fp32_router_weights_reconcile_under_rule_keep_in_fp32(variant, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers keeps gate.weight in fp32: matched, listed under its rule, reconcile OK."""
    ckpt = variant("fp32-router", _routers_fp32)
    result = reconcile_checkpoint(ckpt)
    assert result.ok and result.num_matched == result.num_expected
    assert result.rules_used() == {"keep_in_fp32": 5}
    assert ROUTER in {t.checkpoint_name for t in result.tolerated}
    assert main(["checkpoint", "reconcile", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "tolerated by rule keep_in_fp32: 5 tensor(s)" in out and "_keep_in_fp32_modules_strict" in out


def test_a_log_padded_to_head_dim_loads_only_the_heads_and_reports_the_padding(
        variant, k3_tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A_log [16] for 3 heads: accepted by a_log_padding, padding values named; logits equal the original's."""
    ckpt = variant("a-log-16", _a_log_to(HEAD_DIM, pad=-7.0))
    result = reconcile_checkpoint(ckpt)
    assert result.ok and not result.mismatched
    padded = [t for t in result.tolerated if t.rule == "a_log_padding"]
    assert len(padded) == 4 and A_LOG in {t.checkpoint_name for t in padded}
    assert all("13 padding value(s)" in t.detail and "-7" in t.detail for t in padded)
    assert main(["checkpoint", "reconcile", str(ckpt)]) == 0
    assert "tolerated by rule a_log_padding: 4 tensor(s)" in capsys.readouterr().out
    assert torch.equal(_logits(ckpt), _logits(k3_tiny_dir))


def test_a_log_shorter_than_the_heads_is_refused(variant) -> None:
    ckpt = variant("a-log-2", _a_log_to(HEADS - 1))
    result = reconcile_checkpoint(ckpt)
    assert {(m.module_name.rsplit(".", 1)[-1], m.kind) for m in result.mismatched} == {("A_log", "shape")}
    cfg = ModelConfig.from_file(ckpt)
    with pytest.raises(WeightLoadError, match=r"A_log has 2 entries but the config has 3 KDA heads"):
        ServingModel(cfg, torch.float32).load(CheckpointReader(ckpt))


def test_rules_do_not_excuse_other_faults(variant) -> None:
    """A transposed fp32 router is a shape mismatch (its dtype accepted); an fp32 norm and a 2-D A_log stay
    mismatches; a bf16 router bias is still wrong (no rule narrows a dtype)."""
    norm, bias = f"{P}model.norm.weight", f"{P}model.layers.1.block_sparse_moe.gate.e_score_correction_bias"

    def edit(t: dict[str, torch.Tensor]) -> None:
        t[ROUTER] = t[ROUTER].float().T.contiguous()
        t[norm] = t[norm].float()
        t[A_LOG] = t[A_LOG].reshape(1, -1).contiguous()
        t[bias] = t[bias].to(torch.bfloat16)

    result = reconcile_checkpoint(variant("faults", edit))
    kinds = {m.checkpoint_name: m.kind for m in result.mismatched}
    assert kinds == {ROUTER: "shape", norm: "dtype", A_LOG: "shape", bias: "dtype"}
    assert not result.tolerated
