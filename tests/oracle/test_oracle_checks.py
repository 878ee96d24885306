"""The oracle's registered checks, run through the gate engine: each passes and its control fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import k3verify.gates.checks.oracle.references  # noqa: F401  (registers the checks)
from k3verify.gates import REGISTRY, CheckContext, Status, evaluate_trial
from k3verify.gates.core.check import SkipCheck
from k3verify.gates.core.suite import derive_seed
from k3verify.target import resolve_target

ORACLE_CHECKS = ("oracle.kda.naive_recurrent_vs_chunk", "oracle.kda.gate_vs_fla", "oracle.mxfp4.dequant_vs_hand",
                 "oracle.pins", "oracle.k3_reference_vs_transformers")
_CACHE: dict[str, dict[str, Any]] = {}


def _ctx(preset: str, check_id: str) -> CheckContext:
    gen = torch.Generator().manual_seed(derive_seed(0, check_id))
    return CheckContext(resolve_target(preset), torch.device("cpu"), 0, gen, "quick", _CACHE.setdefault(preset, {}))


@pytest.mark.parametrize("check_id", ORACLE_CHECKS)
def test_oracle_check_passes_and_control_fails_on_kl_tiny(check_id: str) -> None:
    """Each oracle check is green on kl-tiny, and its deliberately wrong control is caught."""
    ctx = _ctx("kl-tiny", check_id)
    check = REGISTRY.get(check_id)
    result = evaluate_trial(check, check.fn(ctx))
    assert result.status is Status.PASS, result.reason
    assert result.control is not None and result.control.status == "fail"
    if check_id == "oracle.k3_reference_vs_transformers":
        loc = result.localization
        assert loc is not None and loc["first_divergent_layer"] is None and len(loc["per_layer"]) == 11
        assert result.instrument is not None and not result.instrument["flag"]


def test_transformers_check_skips_k3_with_reason() -> None:
    """On a K3 preset the transformers comparison is skipped, saying why (never silently)."""
    check = REGISTRY.get("oracle.k3_reference_vs_transformers")
    with pytest.raises(SkipCheck, match="no K3 features"):
        check.fn(_ctx("k3-tiny", check.id))


@pytest.mark.gpu
def test_transformers_with_fla_kernels_check_on_cuda() -> None:
    """On CUDA transformers' KDA routes to fla's Triton kernels; the check passes at fla's bar and its
    control fails."""
    check = REGISTRY.get("oracle.k3_reference_vs_transformers_fla")
    gen = torch.Generator().manual_seed(derive_seed(0, check.id))
    ctx = CheckContext(resolve_target("kl-tiny"), torch.device("cuda"), 0, gen, "quick", {})
    result = evaluate_trial(check, check.fn(ctx))
    assert result.status is Status.PASS, result.reason
    assert result.control is not None and result.control.status == "fail"
    assert any("chunk_kda [package]" in n for n in result.notes), result.notes
