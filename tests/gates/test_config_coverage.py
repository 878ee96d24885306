"""Config-field coverage: every ModelConfig field the serving stack reads turns at least one check red when the
serving model alone gets a wrong value (the oracle keeps the true one); fields that cannot matter on a preset
are listed with the reason (k3verify/gates/core/config_coverage.py). Only each entry's own checks run, with the
oracle models and checkpoint tensors shared per preset."""

from __future__ import annotations

from typing import Any

import pytest

from k3verify.gates.core.check import REGISTRY, Result
from k3verify.gates.core.config_coverage import (
    IRRELEVANT,
    PERTURBATIONS,
    Perturbation,
    config_fields,
    fields_read,
    perturbed,
)
from k3verify.gates.core.suite import load_all_checks, make_context_factory, run_check
from k3verify.gates.shared import builders
from k3verify.target import Target, resolve_target

CASES = [(preset, p) for p in PERTURBATIONS for preset in p.presets]
PRESETS = sorted({preset for preset, _ in CASES})


@pytest.fixture(scope="module")
def shared() -> dict[str, tuple[Target, dict[str, Any]]]:
    """preset -> (target, a check cache that keeps tensors and oracle models across the cases)."""
    load_all_checks()
    return {}


def _run(shared: dict[str, tuple[Target, dict[str, Any]]], preset: str, check_ids: tuple[str, ...],
         serving_cfg: object | None) -> list[Result]:
    if preset not in shared:
        shared[preset] = (resolve_target(preset, None), {})
    target, cache = shared[preset]
    if serving_cfg is not None:
        cache[builders.SERVING_CONFIG] = serving_cfg
    factory = make_context_factory(target, device="cpu", seed=0, suite="full", cache=cache)
    try:
        return [run_check(REGISTRY.get(check_id), factory, 0, "cpu") for check_id in check_ids]
    finally:  # the next case builds its serving model from its own config
        for key in [k for k in cache if k.startswith("serving.model.") or k == builders.SERVING_CONFIG]:
            del cache[key]


def test_the_table_names_every_field_the_serving_stack_reads() -> None:
    """A field read by serving/, kernels/ or api/ without an entry is untested; an entry for a field nothing
    reads is stale."""
    read = fields_read()
    listed = {p.field for p in PERTURBATIONS} | {i.field for i in IRRELEVANT}
    assert set(read) <= config_fields()
    assert not set(read) - listed, f"config fields read but not covered: {sorted(set(read) - listed)}"
    assert not listed - set(read), f"covered but read nowhere (stale entries): {sorted(listed - set(read))}"
    assert "rms_norm_eps" in read and "a_log_width" not in read  # properties resolve to the fields they read


@pytest.mark.parametrize("preset", PRESETS)
def test_the_true_config_keeps_every_killer_green(preset: str, shared: dict[str, tuple[Target, dict[str, Any]]]
                                                  ) -> None:
    """Without a perturbation the same checks pass: a red below is the wrong value's doing."""
    killers = tuple(sorted({k for p in PERTURBATIONS if preset in p.presets for k in p.killers}))
    results = _run(shared, preset, killers, None)
    assert [(r.id, r.status.value) for r in results] == [(k, "pass") for k in killers], \
        [(r.id, r.reason) for r in results if r.status.value != "pass"]


@pytest.mark.parametrize(("preset", "pert"), CASES, ids=[f"{pre}-{p.field}" for pre, p in CASES])
def test_a_wrong_value_in_the_serving_model_alone_turns_a_check_red(
        preset: str, pert: Perturbation, shared: dict[str, tuple[Target, dict[str, Any]]]) -> None:
    cfg = resolve_target(preset, None).cfg if preset not in shared else shared[preset][0].cfg
    wrong = perturbed(cfg, pert)
    assert getattr(wrong, pert.field) != getattr(cfg, pert.field), f"{pert.field}: the wrong value equals the true one"
    red = [r for r in _run(shared, preset, pert.killers, wrong) if r.failed]
    assert red, f"{pert.field} = {getattr(wrong, pert.field)!r} ({pert.mistake}) left {pert.killers} green on {preset}"
    if pert.at_load:
        assert any("WeightLoadError" in str(r.reason) for r in red), [r.reason for r in red]
