"""The CUDA-only checks kernel.moe.grouped_vs_torch / gathered_vs_torch, run on CPU with the registry forced to
the CUDA combine (torch._grouped_mm and bmm run on CPU too): within their bars, controls far outside, and a
wrong expert offset in the fast path is caught."""

from __future__ import annotations

import pytest
import torch

from k3verify.gates import compare
from k3verify.gates.checks.kernels.moe_combine import combine_trial
from k3verify.gates.core.check import REGISTRY as CHECKS
from k3verify.gates.core.suite import load_all_checks, make_context_factory
from k3verify.kernels.moe import grouped
from k3verify.target import resolve_target

IDS = {torch.bfloat16: "kernel.moe.grouped_vs_torch", torch.float32: "kernel.moe.gathered_vs_torch"}


def _judge(preset: str, dtype: torch.dtype) -> tuple[float, float, float]:
    load_all_checks()
    check = CHECKS.get(IDS[dtype])
    ctx = make_context_factory(resolve_target(preset, None), device="cpu", seed=0, suite="full")(
        check, torch.Generator().manual_seed(0))
    trial = combine_trial(ctx, dtype, path="grouped" if dtype == torch.bfloat16 else None)
    assert check.bar is not None
    got = compare(check.kind, trial.reference, trial.candidate, check.bar)
    ctrl = compare(check.kind, trial.reference, trial.control, check.bar)
    return float(got.metric), float(ctrl.metric), check.bar


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", ["k3-tiny", "kl-tiny"])
def test_the_cuda_combine_is_within_its_bar_and_the_control_is_not(preset: str, dtype: torch.dtype,
                                                                   cuda_moe_combine: None) -> None:
    metric, control, bar = _judge(preset, dtype)
    assert metric < bar / 4, f"{preset} {dtype}: {metric:.3g} leaves too little margin under {bar:g}"
    assert control > 100 * bar


def test_a_wrong_expert_offset_in_the_gather_is_caught(cuda_moe_combine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = grouped.moe_gathered_combine

    def off_by_one(x_in, w13, w2, weights, idx, act):  # type: ignore[no-untyped-def]
        return real(x_in, w13, w2, weights, (idx + 1) % w13.shape[0], act)

    monkeypatch.setattr(grouped, "moe_gathered_combine", off_by_one)
    metric, _, bar = _judge("k3-tiny", torch.float32)
    assert metric > bar
