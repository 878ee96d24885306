"""Fixtures for the gate-engine tests: a private registry and a factory for runs without a model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from k3verify.gates import Check, CheckContext, Kind, Registry, SkipCheck, Trial, make_context_factory, run_suite
from k3verify.gates.core.suite import RunResult, collect_run_info
from k3verify.presets import get_preset
from k3verify.target import Target


def model_free_target() -> Target:
    """A target whose files are never read: the engine's own checks need no model."""
    return Target(cfg=get_preset("k3-tiny"), name="test", preset="test", checkpoint_dir=Path("/nonexistent"),
                  digest="sha256:" + "0" * 64)


@pytest.fixture
def registry() -> Registry:
    return Registry()


RunFactory = Callable[[Sequence[Check]], RunResult]


@pytest.fixture
def run_checks() -> RunFactory:
    """Run checks on CPU with no model, the way `parity` would."""

    def run(checks: Sequence[Check], seed: int = 0) -> RunResult:
        factory = make_context_factory(model_free_target(), device="cpu", seed=seed, suite="quick")
        info = collect_run_info(device="cpu", seed=seed, suite="quick", preset="test",
                                checkpoint_digest="sha256:" + "0" * 64)
        return run_suite(list(checks), factory, seed=seed, suite="quick", device="cpu", info=info)

    return run


@pytest.fixture
def mixed_registry(registry: Registry) -> Registry:
    """One check of every outcome: pass, fail, vacuous, error, skipped."""

    @registry.register_check(id="kda.t.pass", component="kda", level="module", kind=Kind.RMS, bar=5e-3,
                             bar_reason="test bar", control="output scaled by 2")
    def passing(ctx: CheckContext) -> Trial:
        r = torch.randn(8, 16, generator=ctx.generator)
        return Trial(reference=r, candidate=r * (1 + 1e-4), control=r * 2, position_dim=0)

    @registry.register_check(id="mla.t.fail", component="mla", level="module", kind=Kind.BF16,
                             control="output negated")
    def failing(ctx: CheckContext) -> Trial:
        r = torch.randn(8, 16, generator=ctx.generator)
        c = r.clone()
        c[3, 5] += 10.0
        return Trial(reference=r, candidate=c, control=-r)

    @registry.register_check(id="moe.t.vacuous", component="moe", level="module", kind=Kind.BITEXACT,
                             control="the control is the candidate itself")
    def vacuous(ctx: CheckContext) -> Trial:
        r = torch.arange(10)
        return Trial(reference=r, candidate=r.clone(), control=r.clone())

    @registry.register_check(id="router.t.error", component="router", level="module", kind=Kind.BF16,
                             control="none")
    def erroring(ctx: CheckContext) -> Trial:
        raise RuntimeError("router exploded")

    @registry.register_check(id="norm.t.skipped", component="norm", level="module", kind=Kind.BF16,
                             control="none")
    def skipped(ctx: CheckContext) -> Trial:
        raise SkipCheck("preset has no norms")

    return registry
