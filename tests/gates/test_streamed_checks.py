"""Model-level checks at "real size" (K3V_WHOLE_MODEL_GIB set below the whole fp32 model, above the slice): the
gold runs streamed and a check that needs another whole model runs on a slice, with the verdicts and metrics the
whole-model run gives; a streamed gold with two layers swapped fails served.vs_gold."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from k3verify.gates.core.check import REGISTRY
from k3verify.gates.core.resources import RESOURCE_METRICS
from k3verify.gates.core.suite import load_all_checks, make_context_factory, run_check
from k3verify.gates.shared import builders
from k3verify.gates.shared.slice import SlicedTensors, slice_context, slice_layers
from k3verify.presets import get_preset
from k3verify.target import resolve_target

# GiB between the slice's fp32 model and the whole fp32 model (bf16 whole fits: the served model is built whole)
LIMITS = {"kl-tiny": 3 / 1024, "k3-tiny": 6 / 1024}
CHECKS = ("served.vs_gold", "model.logits.fp32")


def _measured(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in RESOURCE_METRICS}


def _run(preset: str, check_id: str, cache: dict[str, Any] | None = None) -> Any:
    load_all_checks()
    factory = make_context_factory(resolve_target(preset, None), device="cpu", seed=0, suite="quick",
                                   cache=cache, slicer=slice_context)
    return run_check(REGISTRY.get(check_id), factory, 0, "cpu")


@pytest.mark.parametrize("preset", ["kl-tiny", "k3-tiny"])
def test_streamed_and_sliced_checks_give_the_whole_model_verdicts(preset: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """served.vs_gold with its fp64 gold streamed gives the same metrics bit for bit; model.logits.fp32, whose fp32
    serving model may not be built whole, runs on a slice and passes; each result says how it ran."""
    whole = {c: _run(preset, c) for c in CHECKS}
    monkeypatch.setenv(builders.WHOLE_MODEL_ENV, str(LIMITS[preset]))
    sized = {c: _run(preset, c) for c in CHECKS}
    for c in CHECKS:  # k3-tiny's served.vs_gold skips (its bf16 reference is too far from the gold) either way
        assert whole[c].status == sized[c].status, (c, sized[c].reason, sized[c].notes)
        assert sized[c].status == ("skipped" if (preset, c) == ("k3-tiny", "served.vs_gold") else "pass")
    assert _measured(sized["served.vs_gold"].metrics) == _measured(whole["served.vs_gold"].metrics)
    assert sized["served.vs_gold"].reason == whole["served.vs_gold"].reason
    assert preset == "k3-tiny" or any("float64 oracle ran streamed" in n for n in sized["served.vs_gold"].notes)
    assert not any("streamed" in n for n in whole["served.vs_gold"].notes)
    assert sized["model.logits.fp32"].notes[0].startswith("ran on a slice of the model, decoder layers [0 ")
    assert sized["model.logits.fp32"].control is not None and sized["model.logits.fp32"].control.status == "fail"


def test_a_streamed_gold_with_its_layers_swapped_fails_served_vs_gold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The detector bites: the streamed oracles run layers 1 and 2 in the wrong order, so the served model is far
    from the gold while the baseline (the same wrong order) is near it."""
    monkeypatch.setenv(builders.WHOLE_MODEL_ENV, "0.0001")
    cache: dict[str, Any] = {builders.STREAMED_ORDER: lambda n: [0, 2, 1, *range(3, n)]}
    result = _run("kl-tiny", "served.vs_gold", cache)
    assert result.status == "fail", (result.reason, result.metrics)


def test_the_slice_holds_first_last_and_every_layer_kind() -> None:
    """kl-48b-8l slices to layers 0 (KDA, dense) and 7 (MLA, MoE); a block-residual model keeps a finished block;
    the slice's tensors are the checkpoint's layers renumbered, others left out."""
    assert slice_layers(get_preset("kl-48b-8l")) == [0, 7]
    assert slice_layers(get_preset("kl-tiny")) == [0, 3, 4]
    assert slice_layers(get_preset("k3-tiny")) == [0, 1, 2, 5]
    tensors = {"model.layers.0.w": torch.zeros(1), "model.layers.3.w": torch.ones(1), "model.layers.2.w":
               torch.ones(2), "lm_head.weight": torch.ones(3)}
    sliced = SlicedTensors(tensors, [0, 3])
    assert sorted(sliced) == ["lm_head.weight", "model.layers.0.w", "model.layers.1.w"]
    assert torch.equal(sliced["model.layers.1.w"], tensors["model.layers.3.w"])


def test_attn_res_mix_runs_with_its_fp64_oracle_built_one_layer_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """attn_res.module.fp32 at "real size" on k3-tiny: its fp64 gold does not fit even on the slice, so the oracle's
    layers and output mix are built one at a time; it passes against the same bar as whole, its control fails."""
    monkeypatch.setenv(builders.WHOLE_MODEL_ENV, str(LIMITS["k3-tiny"]))
    result = _run("k3-tiny", "attn_res.module.fp32")
    assert result.status == "pass", (result.reason, result.notes)
    assert result.control is not None and result.control.status == "fail"
    assert any(n.startswith("the float64 oracle's layers were built one at a time") for n in result.notes)


def test_the_strict_loader_check_reads_the_slice_s_own_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """weights.loader.strict on a slice compares the slice's modules with the checkpoint's own layers, renumbered as
    the slice numbers them (k3-syn-25: layers 0-6 and 24; reading layer 7 under its own number was a KeyError)."""
    monkeypatch.setenv(builders.WHOLE_MODEL_ENV, "0.006")
    result = _run("k3-syn-25", "weights.loader.strict")
    assert result.status == "pass", (result.reason, result.traceback)
    assert result.notes[0].startswith("ran on a slice of the model, decoder layers [0 ")
    assert result.control is not None and result.control.status == "fail"


def test_the_strict_loader_check_fails_one_loaded_value_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded module's parameters are views into the byte image the check compares: a loader that stores one
    value wrong fails `values`, though every name loads (the control's lenient loader does not see it)."""
    import k3verify.gates.checks.weights.loader as loader_check

    load = loader_check.load_into

    def one_off(module: torch.nn.Module, cfg: Any, mapping: Any) -> None:
        load(module, cfg, mapping)
        with torch.no_grad():
            param = next(t for t in module.state_dict(keep_vars=True).values()
                         if t.dtype.is_floating_point and not t.is_meta)
            param.view(-1)[7] += 1

    monkeypatch.setattr(loader_check, "load_into", one_off)
    result = _run("k3-syn-25", "weights.loader.strict")
    assert result.status == "fail" and "[values]" in result.reason, (result.reason, result.traceback)


def test_the_reference_cross_check_runs_on_a_slice_with_one_kda_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """kl-48b-8l's slice (layers 0 and 7) holds one KDA layer: the cross-check of the two references runs on it with
    that layer's o_norm scaled as its control (it skipped before: its control swapped two layers' o_norm)."""
    from k3verify.gates.shared import slice as slice_mod

    monkeypatch.setenv(builders.WHOLE_MODEL_ENV, str(LIMITS["kl-tiny"]))
    monkeypatch.setattr(slice_mod, "slice_layers", lambda cfg: [0, 3])  # kl-tiny: layer 0 KDA, layer 3 MLA
    result = _run("kl-tiny", "oracle.k3_reference_vs_transformers")
    assert result.status == "pass", (result.reason, result.notes)
    assert result.notes[0].startswith("ran on a slice of the model, decoder layers [0 kda/dense, 3 mla/moe]")
    assert "one KDA layer (nothing to swap its o_norm with): the control scales its o_norm by 1.5" in result.notes
    assert result.control is not None and result.control.status == "fail"


def test_the_loader_tolerance_check_runs_on_a_slice_with_one_kda_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tolerated A_log and the refused one are separate loads, so one KDA layer serves both: on a slice with one
    the check runs and passes, its rule-free control fails."""
    from k3verify.gates.shared import slice as slice_mod

    monkeypatch.setenv(builders.WHOLE_MODEL_ENV, "0.0015")  # a bf16 host copy: the slice's 1.40 MB, not the 1.81
    monkeypatch.setattr(slice_mod, "slice_layers", lambda cfg: [0, 3])
    result = _run("kl-tiny", "weights.loader.tolerances")
    assert result.status == "pass", (result.reason, result.notes)
    assert result.notes[0].startswith("ran on a slice of the model, decoder layers [0 kda/dense, 3 mla/moe]")
    assert result.control is not None and result.control.status == "fail"
