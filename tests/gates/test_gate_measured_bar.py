"""A bar measured at run time (Trial.bar) judges the trial, is recorded as the result's bar, and can never
loosen the check past its registered cap or apply to a kind with fixed bars."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from k3verify.gates import Check, CheckContext, Kind, Registry, Trial
from k3verify.gates.core.suite import RunResult

RunFactory = Callable[[Sequence[Check]], RunResult]


def test_measured_bar_judges_and_is_recorded(registry: Registry, run_checks: RunFactory) -> None:
    """A 1e-3 error passes the registered 5e-2 cap but fails a measured 1e-4 bar, which the result records."""

    def trial(bar: float) -> Callable[[CheckContext], Trial]:
        def fn(ctx: CheckContext) -> Trial:
            r = torch.randn(64, generator=ctx.generator)
            return Trial(reference=r, candidate=r * (1 + 1e-3), control=r * 2, bar=bar)
        return fn

    for name, bar in (("loose", 4e-2), ("tight", 1e-4)):
        registry.register_check(id=f"gates.t.{name}", component="gates", level="module", kind=Kind.RMS, bar=5e-2,
                                bar_reason="cap for a measured bar", control="doubled")(trial(bar))
    results = {r.id: r for r in run_checks(list(registry)).results}
    assert results["gates.t.loose"].status == "pass" and results["gates.t.loose"].bar == 4e-2
    assert results["gates.t.tight"].status == "fail" and results["gates.t.tight"].bar == 1e-4


def test_measured_bar_above_cap_or_on_fixed_kinds_is_an_error(registry: Registry, run_checks: RunFactory) -> None:
    """A measurement above the cap, or a bar on a BF16 check, makes the check an error naming the value."""

    @registry.register_check(id="gates.t.over", component="gates", level="module", kind=Kind.RMS, bar=1e-2,
                             bar_reason="cap", control="doubled")
    def over(ctx: CheckContext) -> Trial:
        r = torch.ones(4)
        return Trial(reference=r, candidate=r, control=r * 2, bar=0.5)

    @registry.register_check(id="gates.t.bf16", component="gates", level="module", kind=Kind.BF16, control="doubled")
    def bf16(ctx: CheckContext) -> Trial:
        r = torch.ones(4)
        return Trial(reference=r, candidate=r, control=r * 2, bar=1e-3)

    results = {r.id: r for r in run_checks(list(registry)).results}
    assert results["gates.t.over"].status == "error" and "measured bar 0.5 is outside (0, 0.01]" in \
        str(results["gates.t.over"].reason)
    assert results["gates.t.bf16"].status == "error" and "only RMS checks take a measured bar" in \
        str(results["gates.t.bf16"].reason)
