"""Localization: the first divergent layer and the error curves over depth and position."""

from __future__ import annotations

import math

import torch

from k3verify.gates import Kind, Trial, evaluate_trial
from k3verify.gates.core.check import make_check
from k3verify.gates.core.compare import error_over_position, localize_layers
from k3verify.gates.core.suite import RunResult, collect_run_info
from k3verify.gates.report.html import render_html
from k3verify.gates.report.json_report import report_dict


def _layers(fault_at: int | None, n: int = 6) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Per-layer outputs where a fault at one layer propagates to every later layer, as in a real stack."""
    g = torch.Generator().manual_seed(0)
    out, err = [], torch.zeros(10, 12)
    for i in range(n):
        ref = torch.randn(10, 12, generator=g)
        if i == fault_at:
            err = torch.full((10, 12), 0.05)
        out.append((f"layers.{i}", ref, ref + err + 1e-7 * torch.randn(10, 12, generator=g)))
    return out


def test_first_divergent_layer_is_the_injected_one() -> None:
    per_layer, first = localize_layers(Kind.RMS, _layers(fault_at=3))
    assert first == "layers.3"
    assert [e.passed for e in per_layer] == [True, True, True, False, False, False]
    assert per_layer[2].rel_rms < 1e-5 < 1e-2 < per_layer[3].rel_rms


def test_no_fault_means_no_divergent_layer() -> None:
    per_layer, first = localize_layers(Kind.RMS, _layers(fault_at=None))
    assert first is None and all(e.passed for e in per_layer)


def test_error_over_position_peaks_at_the_broken_token() -> None:
    ref = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(1))
    cand = ref.clone()
    cand[:, 6] += 0.5
    curve = error_over_position(ref, cand, position_dim=1)
    assert len(curve) == 9
    assert max(curve, key=lambda p: p.rel_rms).position == 6
    assert all(p.max_abs == 0.0 for p in curve if p.position != 6)


def test_trial_localization_reaches_result_report_and_html() -> None:
    layers = _layers(fault_at=3)
    check = make_check(lambda ctx: None, id="model.t.stack", component="model", level="model",  # type: ignore[arg-type]
                       kind=Kind.RMS, bar=5e-3, bar_reason="test bar", control="fault from layer 0")
    trial = Trial(reference=layers[-1][1], candidate=layers[-1][2], control=layers[-1][1] * 2, layers=layers,
                  position_dim=0, control_layers=_layers(fault_at=0))
    result = evaluate_trial(check, trial)
    assert result.localization is not None and result.localization["first_divergent_layer"] == "layers.3"
    assert len(result.localization["per_position"]) == 10
    assert result.control is not None and result.control.first_divergent_layer == "layers.0"
    info = collect_run_info(device="cpu", seed=0, suite="quick")
    html = render_html(report_dict(RunResult(info, [result])))
    assert "error over depth" in html and "error over position" in html and html.count("<polyline") >= 4
    assert "first divergent layer: <b>layers.3</b>" in html


def test_non_finite_layer_output_is_divergent() -> None:
    layers = _layers(fault_at=None)
    layers[4][2][0, 0] = math.nan
    _, first = localize_layers(Kind.BF16, layers)
    assert first == "layers.4"
