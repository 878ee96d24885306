"""Registration rules and the status rules: fail, vacuous, error, skipped, thin, instrument suspect."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from k3verify.gates import CheckContext, Kind, Registry, Status, Trial, evaluate_trial
from k3verify.gates.core.check import make_check
from k3verify.gates.core.suite import RunResult

RunFactory = Callable[..., RunResult]  # the run_checks fixture (conftest.py)


def _noop(ctx: CheckContext) -> Trial:
    raise NotImplementedError


def _spec(**over: object) -> dict[str, object]:
    spec: dict[str, object] = {"id": "kda.t.x", "component": "kda", "level": "module", "kind": Kind.BITEXACT,
                               "control": "something broken"}
    spec.update(over)
    return spec


def test_rms_bar_override_without_reason_raises_at_registration(registry: Registry) -> None:
    with pytest.raises(ValueError, match="needs a one-line bar_reason"):
        registry.register_check(**_spec(kind=Kind.RMS, bar=1e-2))(_noop)
    assert "kda.t.x" not in registry
    registry.register_check(**_spec(kind=Kind.RMS, bar=1e-2, bar_reason="K=16k bf16 GEMM accumulates ~1e-2"))(_noop)
    assert registry.get("kda.t.x").bar == 1e-2


@pytest.mark.parametrize(("over", "message"), [
    ({"kind": Kind.BITEXACT, "bar": 1e-3, "bar_reason": "x"}, "only RMS checks take a bar"),
    ({"kind": Kind.BF16, "bar": 1e-3, "bar_reason": "x"}, "only RMS checks take a bar"),
    ({"kind": Kind.RMS, "bar": -1.0, "bar_reason": "x"}, "positive finite"),
    ({"kind": Kind.RMS}, "an RMS check needs noise="),
    ({"kind": Kind.RMS, "noise": "a vs b", "bar": 1e-3, "bar_reason": "x"}, "takes kind RMS and no bar"),
    ({"kind": Kind.BF16, "noise": "a vs b"}, "takes kind RMS and no bar"),
    ({"kind": Kind.RMS, "noise": "  "}, "must name the two references"),
    ({"bar_reason": "why"}, "bar_reason given without a bar"),
    ({"component": "kdaa"}, "component must be one of"),
    ({"level": "layer"}, "level must be one of"),
    ({"kind": "fp8"}, "kind must be one of"),
    ({"id": "NoDots"}, "id must be dotted"),
    ({"control": "  "}, "control must say"),
    ({"suites": ("nightly",)}, "suites must be"),
    ({"devices": ("tpu",)}, "devices must be"),
])
def test_invalid_specs_raise_naming_the_field(over: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_check(_noop, **_spec(**over))  # type: ignore[arg-type]


def test_bitexact_needs_no_bar() -> None:
    assert make_check(_noop, **_spec(kind=Kind.BITEXACT)).bar is None  # type: ignore[arg-type]


def test_duplicate_ids_raise(registry: Registry) -> None:
    def other(ctx: CheckContext) -> Trial:
        raise NotImplementedError

    registry.register_check(**_spec())(_noop)
    with pytest.raises(ValueError, match="duplicate check id 'kda.t.x'"):
        registry.register_check(**_spec())(other)
    # The same function registering again (a module reloaded) is not a duplicate.
    registry.register_check(**_spec())(_noop)
    assert len(registry) == 1


def _check(kind: Kind = Kind.RMS, **over: object):  # noqa: ANN202
    if kind is Kind.RMS and "bar" not in over and "noise" not in over:
        over.update(bar=5e-3, bar_reason="the engine's default RMS bar, for the rule tests")
    return make_check(_noop, **_spec(kind=kind, **over))  # type: ignore[arg-type]


def test_control_passing_makes_the_check_vacuous_even_when_candidate_passes() -> None:
    r = torch.randn(32)
    result = evaluate_trial(_check(), Trial(reference=r, candidate=r.clone(), control=r * (1 + 1e-4)))
    assert result.status is Status.VACUOUS and result.control is not None and result.control.status == "pass"
    assert "control passed" in str(result.reason)


def test_vacuous_check_makes_the_run_fail(mixed_registry: Registry, run_checks: RunFactory) -> None:
    run = run_checks([mixed_registry.get("kda.t.pass"), mixed_registry.get("moe.t.vacuous")])
    assert [r.status for r in run.results] == [Status.PASS, Status.VACUOUS]
    assert run.verdict == "fail"


def test_failing_candidate_is_fail_and_records_worst_element() -> None:
    r = torch.randn(4, 8)
    c = r.clone()
    c[2, 7] += 1.0
    result = evaluate_trial(_check(Kind.BF16), Trial(reference=r, candidate=c, control=-r))
    assert result.status is Status.FAIL and result.worst is not None and result.worst.index == (2, 7)
    assert result.control is not None and result.control.status == "fail"


def test_nan_in_candidate_fails_even_if_control_fails() -> None:
    r = torch.randn(16)
    c = r.clone()
    c[0] = float("nan")
    result = evaluate_trial(_check(), Trial(reference=r, candidate=c, control=r * 3))
    assert result.status is Status.FAIL and "non-finite" in str(result.reason)


def test_thin_margin_is_flagged() -> None:
    r = torch.ones(100, dtype=torch.float64)
    result = evaluate_trial(_check(), Trial(reference=r, candidate=r + 4.5e-3, control=r * 2))
    assert result.status is Status.PASS and result.thin and result.margin == pytest.approx(0.9)
    comfortable = evaluate_trial(_check(), Trial(reference=r, candidate=r + 1e-3, control=r * 2))
    assert not comfortable.thin


def test_exceptions_become_error_with_traceback_and_skips_are_skipped(
    mixed_registry: Registry, run_checks: RunFactory
) -> None:
    run = run_checks(list(mixed_registry))
    by_id = {r.id: r for r in run.results}
    err = by_id["router.t.error"]
    assert err.status is Status.ERROR and "router exploded" in str(err.reason)
    assert err.traceback is not None and "erroring" in err.traceback
    assert by_id["norm.t.skipped"].status is Status.SKIPPED and by_id["norm.t.skipped"].reason == "preset has no norms"
    # The error did not stop later checks from running.
    assert len(run.results) == 5 and by_id["kda.t.pass"].status is Status.PASS


def test_check_returning_non_trial_is_an_error(registry: Registry, run_checks: RunFactory) -> None:
    @registry.register_check(**_spec())
    def returns_tensor(ctx: CheckContext) -> Trial:
        return torch.ones(3)  # type: ignore[return-value]

    (result,) = run_checks(list(registry)).results
    assert result.status is Status.ERROR and "must return a Trial" in str(result.reason)


def test_cuda_only_check_is_skipped_with_reason_on_cpu(registry: Registry, run_checks: RunFactory) -> None:
    @registry.register_check(**_spec(devices=("cuda",)))
    def needs_cuda(ctx: CheckContext) -> Trial:
        raise AssertionError("must not run on CPU")

    (result,) = run_checks(list(registry)).results
    assert result.status is Status.SKIPPED and "needs cuda" in str(result.reason)


def _bf16_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Prefix sums with a bf16 accumulator (torch.cumsum on bf16 accumulates in fp32 on CPU)."""
    acc = torch.zeros(x.shape[0], dtype=torch.bfloat16)
    out = []
    for j in range(x.shape[1]):
        acc = acc + x[:, j].bfloat16()
        out.append(acc.float())
    return torch.stack(out, dim=-1)


def test_instrument_flags_a_low_precision_reference() -> None:
    """Reference accumulated in bf16, candidate in fp32, gold in fp64: the candidate is not to blame."""
    x = torch.rand(8, 1024, generator=torch.Generator().manual_seed(3))
    trial = Trial(reference=_bf16_cumsum(x), candidate=x.cumsum(-1), control=x.cumsum(-1) * 1.1,
                  gold=x.double().cumsum(-1))
    result = evaluate_trial(_check(), trial)
    assert result.status is Status.FAIL
    assert result.instrument is not None and result.instrument["flag"]
    assert result.instrument["ref_to_gold"] > 10 * result.instrument["cand_to_gold"]
    assert "instrument suspect" in str(result.reason)


def test_instrument_blames_a_low_precision_candidate() -> None:
    """Swap roles: now the candidate is the bf16 one and the instrument must not be flagged."""
    x = torch.rand(8, 1024, generator=torch.Generator().manual_seed(3))
    trial = Trial(reference=x.cumsum(-1), candidate=_bf16_cumsum(x), control=x.cumsum(-1) * 1.1,
                  gold=x.double().cumsum(-1))
    result = evaluate_trial(_check(), trial)
    assert result.status is Status.FAIL and result.instrument is not None and not result.instrument["flag"]
    assert "instrument suspect" not in str(result.reason)
