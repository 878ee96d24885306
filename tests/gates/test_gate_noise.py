"""Bars from measured noise (gates/core/noise.py): the rule, where the noise comes from, the recording, the report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from k3verify.gates import Check, CheckContext, Kind, Registry, Status, Trial, evaluate_trial
from k3verify.gates.core import noise as nz
from k3verify.gates.core.check import make_check
from k3verify.gates.core.suite import RunResult, load_all_checks, make_context_factory, run_check
from k3verify.gates.report.json_report import load_report, write_reports
from k3verify.target import Target, resolve_target

RunFactory = Callable[..., RunResult]  # the run_checks fixture (conftest.py)


def _noop(ctx: CheckContext) -> Trial:
    raise NotImplementedError


def _noisy_check() -> Check:
    return make_check(_noop, id="kda.t.noisy", component="kda", level="module", kind=Kind.RMS,
                      noise="the test reference in fp32 vs fp64", control="scaled by 2")


def _pair(rel: float, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) whose relative RMS distance is `rel`: the noise of a made-up reference."""
    high = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return (high * (1 + rel)).float(), high


def test_bar_is_four_times_the_noise_above_a_floor_of_four_unit_roundoffs() -> None:
    assert nz.derive_bar(1e-5, "float32")[0] == pytest.approx(4e-5)
    floor = nz.derive_bar(1e-10, "float32")
    assert floor[0] == 4 * 2.0**-24 and "through the floor" in floor[1]  # > 100x the noise: the reason is written
    assert nz.derive_bar(1e-2, "bfloat16")[0] == pytest.approx(4e-2)
    assert "through the floor" not in nz.derive_bar(1e-5, "float32")[1]
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(nz.NoiseError, match="finite number"):
            nz.derive_bar(bad, "float32")
    with pytest.raises(nz.NoiseError, match="no unit roundoff"):
        nz.derive_bar(1e-5, "int8")


def test_the_bar_comes_from_the_reference_pair_never_from_the_candidate() -> None:
    """The same pair with a good and a bad candidate: one bar; the bad candidate fails it."""
    check = _noisy_check()
    r = torch.randn(256, generator=torch.Generator().manual_seed(0))
    good = evaluate_trial(check, Trial(reference=r, candidate=r * (1 + 1e-7), control=r * 2, noise=_pair(1e-6)))
    bad = evaluate_trial(check, Trial(reference=r, candidate=r * (1 + 1e-3), control=r * 2, noise=_pair(1e-6)))
    assert good.bar == bad.bar == pytest.approx(4e-6, rel=1e-3)
    assert good.status is Status.PASS and bad.status is Status.FAIL
    assert good.bar_source == "noise" and good.noise is not None and good.noise["source"] == "measured"
    assert good.noise["dtype"] == "float32" and good.noise["pair"] == "the test reference in fp32 vs fp64"


def test_a_noise_barred_check_with_neither_recording_nor_pair_is_an_error(registry: Registry,
                                                                          run_checks: RunFactory) -> None:
    @registry.register_check(id="kda.t.nopair", component="kda", level="module", kind=Kind.RMS,
                             noise="a pair it never returns", control="scaled")
    def no_pair(ctx: CheckContext) -> Trial:
        assert ctx.needs_noise  # the test target has no recording
        r = torch.randn(8, generator=ctx.generator)
        return Trial(reference=r, candidate=r, control=r * 2)

    (result,) = run_checks(list(registry)).results
    assert result.status is Status.ERROR and "returned no noise pair" in str(result.reason)
    assert "no recording for preset 'test'" in str(result.reason)


def test_a_recorded_noise_is_used_and_a_stale_one_is_reported() -> None:
    check = _noisy_check()
    r = torch.randn(64, generator=torch.Generator().manual_seed(0))
    recorded = nz.NoiseLookup(2e-6, "float32", None)
    same = evaluate_trial(check, Trial(reference=r, candidate=r, control=r * 2, noise=_pair(1.5e-6)), recorded)
    assert same.bar == pytest.approx(8e-6) and same.noise["source"] == "recorded"  # type: ignore[index]
    assert same.noise["observed"] == pytest.approx(1.5e-6, rel=1e-3) and not same.notes  # type: ignore[index]
    stale = evaluate_trial(check, Trial(reference=r, candidate=r, control=r * 2, noise=_pair(1e-5)), recorded)
    assert stale.bar == pytest.approx(8e-6) and any("looks stale" in n for n in stale.notes)


def _target(preset: str | None, digest: str) -> Target:
    return Target(cfg=resolve_target("k3-tiny").cfg, name="t", preset=preset, checkpoint_dir=Path("/nonexistent"),
                  digest=digest)


def test_the_recording_applies_only_to_its_preset_digest_device_and_seed() -> None:
    rec = {"presets": {"p": {"digest": "sha256:aa", "device": "cpu", "seed": 0,
                             "checks": {"kda.t.noisy": {"noise": 3e-7, "dtype": "float32"}}}}}
    found = nz.lookup(_target("p", "sha256:aa"), "cpu", 0, "kda.t.noisy", rec)
    assert (found.value, found.dtype, found.why_not) == (3e-7, "float32", None)
    for target, device, seed, why in [
        (_target(None, "sha256:aa"), "cpu", 0, "checkpoint target"),
        (_target("p", "sha256:bb"), "cpu", 0, "checkpoint digest"),
        (_target("p", "sha256:aa"), "cuda", 0, "this run: cuda"),
        (_target("p", "sha256:aa"), "cpu", 7, "seed 7"),
        (_target("q", "sha256:aa"), "cpu", 0, "no recording for preset 'q'"),
    ]:
        miss = nz.lookup(target, device, seed, "kda.t.noisy", rec)
        assert miss.value is None and why in str(miss.why_not)
    assert "no recorded noise" in str(nz.lookup(_target("p", "sha256:aa"), "cpu", 0, "kda.t.other", rec).why_not)


def test_every_recorded_check_is_noise_barred_and_every_recorded_bar_follows_the_rule() -> None:
    """The committed noise.json: no stale ids, each bar = the rule applied to its noise, and a bar above
    100x its noise only through the floor (whose reason the derivation carries)."""
    data = json.loads(nz.RECORDING.read_text())
    noisy = {c.id for c in load_all_checks() if c.noise is not None}
    recorded: set[str] = set()
    for preset, entry in data["presets"].items():
        assert entry["device"] == nz.RECORDED_DEVICE and entry["seed"] == nz.RECORDED_SEED, preset
        for check_id, rec in entry["checks"].items():
            recorded.add(check_id)
            bar, derivation = nz.derive_bar(rec["noise"], rec["dtype"])
            assert rec["bar"] == pytest.approx(bar) and rec["derivation"] == derivation, (preset, check_id)
            if bar > nz.MAX_OVER_NOISE * rec["noise"]:
                assert nz.FLOOR_REASON in derivation
    assert recorded <= noisy, f"stale ids in noise.json: {sorted(recorded - noisy)}"
    assert noisy <= recorded, f"noise-barred checks never recorded: {sorted(noisy - recorded)}"


def test_the_recording_matches_a_fresh_measurement_on_k3_tiny() -> None:
    """Re-measure a few checks: the recording is current for this preset's bytes and this code."""
    target = resolve_target("k3-tiny")
    entry = json.loads(nz.RECORDING.read_text())["presets"]["k3-tiny"]
    assert entry["digest"] == target.digest, "k3-tiny's checkpoint changed: run tools/measure_noise.py"
    factory = make_context_factory(target, device="cpu", seed=0, suite="full", measure_noise=True)
    checks = {c.id: c for c in load_all_checks()}
    for check_id in ("kda.module.fp32", "attn_res.module.fp32", "model.logits.fp32", "mla.decode.absorbed"):
        result = run_check(checks[check_id], factory, 0, "cpu")
        assert result.status is Status.PASS and result.noise is not None, (check_id, result.reason)
        assert result.noise["source"] == "measured"
        recorded = entry["checks"][check_id]["noise"]
        assert recorded / nz.OBSERVED_DRIFT <= result.noise["value"] <= recorded * nz.OBSERVED_DRIFT, check_id


def test_the_report_shows_each_bar_with_its_noise_and_derivation(registry: Registry, run_checks: RunFactory,
                                                                 tmp_path: Path) -> None:
    @registry.register_check(id="kda.t.noisy", component="kda", level="module", kind=Kind.RMS,
                             noise="the test reference in fp32 vs fp64", control="scaled by 2")
    def noisy(ctx: CheckContext) -> Trial:
        r = torch.randn(64, generator=ctx.generator)
        return Trial(reference=r, candidate=r, control=r * 2, noise=_pair(1e-6))

    @registry.register_check(id="kda.t.fixed", component="kda", level="module", kind=Kind.RMS, bar=1e-3,
                             bar_reason="a fixed bar with its reason", control="scaled by 2")
    def fixed(ctx: CheckContext) -> Trial:
        r = torch.randn(64, generator=ctx.generator)
        return Trial(reference=r, candidate=r, control=r * 2)

    write_reports(run_checks(list(registry)), tmp_path)
    by_id = {r["id"]: r for r in load_report(tmp_path)["results"]}  # schema-validated
    assert by_id["kda.t.noisy"]["bar_source"] == "noise" and by_id["kda.t.fixed"]["bar_source"] == "fixed"
    derivation = by_id["kda.t.noisy"]["noise"]["derivation"]
    assert derivation.startswith("bar = max(4 x noise") and by_id["kda.t.fixed"]["noise"] is None
    html = (tmp_path / "report.html").read_text()
    assert 'id="bars"' in html and derivation in html and "a fixed bar with its reason" in html
