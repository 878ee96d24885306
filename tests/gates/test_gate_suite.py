"""The runner: selection, per-check seeding, verdict, run metadata, check-module import failures."""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable

import pytest
import torch

import k3verify
from k3verify.errors import UsageError
from k3verify.gates import CheckContext, Kind, Registry, Status, Trial, load_all_checks, select_checks
from k3verify.gates.core.suite import RunResult, derive_seed, import_error_results, verdict

RunFactory = Callable[..., RunResult]  # the run_checks fixture (conftest.py)


def _seed_probe(registry: Registry, check_id: str) -> None:
    @registry.register_check(id=check_id, component="gates", level="module", kind=Kind.RMS, bar=5e-3,
                             bar_reason="test bar", control="scaled")
    def probe(ctx: CheckContext) -> Trial:
        r = torch.randn(16, generator=ctx.generator) + 3.0
        return Trial(reference=r, candidate=r, control=r * 2, metrics={"first_draw": float(r[0]), "seed": ctx.seed})


def test_each_check_gets_a_stable_seed_independent_of_order(registry: Registry, run_checks: RunFactory) -> None:
    _seed_probe(registry, "gates.t.alpha")
    _seed_probe(registry, "gates.t.beta")
    checks = list(registry)
    forward = {r.id: (r.seed, r.metrics["first_draw"]) for r in run_checks(checks, seed=7).results}
    backward = {r.id: (r.seed, r.metrics["first_draw"]) for r in run_checks(checks[::-1], seed=7).results}
    assert forward == backward
    assert forward["gates.t.alpha"][0] == zlib.crc32(b"7:gates.t.alpha") == derive_seed(7, "gates.t.alpha")
    assert forward["gates.t.alpha"][1] != forward["gates.t.beta"][1]
    other_seed = {r.id: r.metrics["first_draw"] for r in run_checks(checks, seed=8).results}
    assert other_seed["gates.t.alpha"] != forward["gates.t.alpha"][1]


def test_select_by_suite_glob_and_prefix(registry: Registry) -> None:
    for cid, suites in (("kda.conv.a", ("quick", "full")), ("kda.chunk.b", ("full",)), ("mla.rope.c", ("quick",))):
        registry.register_check(id=cid, component=cid.split(".")[0], level="module", kind=Kind.BITEXACT,
                                control="x", suites=suites)(lambda ctx: None)
    ids = lambda checks: [c.id for c in checks]  # noqa: E731
    assert ids(select_checks(registry, "quick")) == ["kda.conv.a", "mla.rope.c"]
    assert ids(select_checks(registry, "full")) == ["kda.chunk.b", "kda.conv.a"]
    assert ids(select_checks(registry, "full", ["kda"])) == ["kda.chunk.b", "kda.conv.a"]
    assert ids(select_checks(registry, "quick", ["*.rope.*", "kda.conv.a"])) == ["kda.conv.a", "mla.rope.c"]
    with pytest.raises(UsageError, match=r"--only 'nope\*' matches no check"):
        select_checks(registry, "quick", ["kda", "nope*"])
    with pytest.raises(UsageError, match="only in another suite: kda.chunk.b"):
        select_checks(registry, "quick", ["kda.chunk"])


@pytest.mark.parametrize(("statuses", "expected"), [
    ([Status.PASS, Status.SKIPPED], "pass"),
    ([Status.PASS], "pass"),
    ([Status.SKIPPED, Status.SKIPPED], "inconclusive"),
    ([], "inconclusive"),
    ([Status.PASS, Status.FAIL], "fail"),
    ([Status.PASS, Status.VACUOUS], "fail"),
    ([Status.PASS, Status.ERROR], "fail"),
])
def test_verdict_red_on_any_red_result_inconclusive_when_nothing_ran(statuses: list[Status], expected: str) -> None:
    from k3verify.gates.core.check import Result

    results = [Result(id=f"gates.t.r{i}", component="gates", level="module", kind="rms", bar=5e-3, bar_reason=None,
                      status=s) for i, s in enumerate(statuses)]
    assert verdict(results) == expected


def test_run_metadata(monkeypatch: pytest.MonkeyPatch, mixed_registry: Registry, run_checks: RunFactory) -> None:
    monkeypatch.setenv("K3V_TEST_KNOB", "on")
    monkeypatch.setenv("NOT_K3V_THING", "x")
    run = run_checks([mixed_registry.get("kda.t.pass")], seed=3).run
    assert run.environment.get("K3V_TEST_KNOB") == "on" and "NOT_K3V_THING" not in run.environment
    assert run.k3verify_version == k3verify.__version__
    assert run.git_sha == "unknown" or re.fullmatch(r"[0-9a-f]{40}", run.git_sha)
    assert run.torch == torch.__version__ and run.device == "cpu" and run.seed == 3 and run.suite == "quick"
    assert run.checkpoint_digest == "sha256:" + "0" * 64 and run.wall_time_s > 0 and run.started_at


def test_a_broken_check_module_becomes_an_error_result() -> None:
    (result,) = import_error_results({"k3verify.gates.checks.kda_conv": "Traceback...\nSyntaxError: bad"})
    assert result.status is Status.ERROR and result.id == "gates.import.kda_conv"
    assert "SyntaxError: bad" in str(result.reason)
    (odd,) = import_error_results({"k3verify.gates.checks.KDA-v2": "Traceback...\nImportError: x"})
    assert odd.id == "gates.import.kda_v2"


def test_every_check_module_imports_and_selftests_are_registered() -> None:
    """A check file that fails to import would drop its gates; this names it."""
    ids = {c.id for c in load_all_checks()}
    from k3verify.gates.checks import IMPORT_ERRORS

    assert IMPORT_ERRORS == {}, "\n\n".join(f"{m}:\n{tb}" for m, tb in IMPORT_ERRORS.items())
    assert {"gates.selftest.fp32_sum_order", "gates.selftest.bitexact_pack", "gates.selftest.bf16_linear",
            "gates.selftest.layer_stack"} <= ids


def test_selftest_checks_pass_and_their_controls_fail(run_checks: RunFactory) -> None:
    run = run_checks(select_checks(load_all_checks(), "quick", ["gates.selftest"]))
    assert len(run.results) == 4
    for r in run.results:
        assert r.status is Status.PASS, (r.id, r.reason)
        assert r.control is not None and r.control.status == "fail", r.id
    assert run.verdict == "pass"


def test_a_check_that_runs_out_of_cuda_memory_runs_again_with_the_cached_models_dropped(registry: Registry) -> None:
    """At real size the models a run caches fill the card: a check that then runs out of CUDA memory runs again from
    its start with every cached model (its slice's too) dropped, and its first note says so; data stays cached."""
    from k3verify.gates.core.suite import make_context_factory, run_check
    from k3verify.target import resolve_target

    calls: list[int] = []

    @registry.register_check(id="gates.t.oom", component="gates", level="module", kind=Kind.RMS, bar=5e-3,
                             bar_reason="test bar", control="scaled")
    def oom(ctx: CheckContext) -> Trial:
        calls.append(len(ctx.cache))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        r = torch.randn(16, generator=ctx.generator) + 3.0
        return Trial(reference=r, candidate=r, control=r * 2)

    cache = {"serving.model.bfloat16.cached": torch.nn.Linear(1, 1), "tensors": {"w": torch.zeros(1)},
             "slice.cache": {"oracle.hf.float32": torch.nn.Linear(1, 1), "target": "kept"}}
    factory = make_context_factory(resolve_target("kl-tiny"), device="cpu", seed=0, suite="quick", cache=cache)
    result = run_check(registry.get("gates.t.oom"), factory, 0, "cpu")
    assert result.status == Status.PASS and len(calls) == 2
    assert result.notes[0] == ("ran a second time after running out of CUDA memory, with the run's cached models "
                               "dropped (serving.model.bfloat16.cached, oracle.hf.float32)")
    assert set(cache) == {"tensors", "slice.cache"} and cache["slice.cache"] == {"target": "kept"}


def test_a_check_records_the_host_memory_it_peaked_at(registry: Registry) -> None:
    """Each check's resident host peak is in its metrics (Linux), measured from the check's start: a check that
    holds 256 MiB more than the run before it shows it, one that holds nothing more does not."""
    from k3verify.gates.core.suite import make_context_factory, run_check
    from k3verify.plan.host_memory import reset_host_peak
    from k3verify.target import resolve_target

    if not reset_host_peak():
        pytest.skip("the host's resident peak cannot be reset here (no /proc/self/clear_refs)")

    def register(check_id: str, extra_bytes: int) -> None:
        @registry.register_check(id=check_id, component="gates", level="module", kind=Kind.BITEXACT, control="one")
        def fn(ctx: CheckContext) -> Trial:
            held = torch.ones(extra_bytes, dtype=torch.uint8)
            r = torch.zeros(4)
            return Trial(reference=r, candidate=r + held[:4].sum() * 0, control=r + 1)

    register("gates.t.small", 0)
    register("gates.t.large", 256 << 20)
    factory = make_context_factory(resolve_target("kl-tiny"), device="cpu", seed=0, suite="quick")
    small = run_check(registry.get("gates.t.small"), factory, 0, "cpu")
    large = run_check(registry.get("gates.t.large"), factory, 0, "cpu")
    assert small.status == large.status == Status.PASS
    grown = (large.metrics["host_peak_gib"] - small.metrics["host_peak_gib"]) * 2**30
    assert 200 << 20 < grown < 400 << 20, grown / 2**20
