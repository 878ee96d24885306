"""The convention catalog: every identifiable alternative moves the oracle far beyond its own noise and is undone
exactly afterwards; assignments are parsed strictly and refused where the site does not exist."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from k3verify.oracle import active
from k3verify.oracle import functional as Fn
from k3verify.oracle.conventions import CATALOG, Assignment, alternatives_for, applied, by_name, parse_assignment
from k3verify.oracle.identify import IDENTIFIABLE_FACTOR, logprob_distance, logprobs, oracle, prompts
from k3verify.presets import SYNTHETIC_PRESETS, get_preset

DOC = Path(__file__).resolve().parents[2] / "docs" / "conventions.md"
CASES = [(c.name, alt.value, preset) for c in CATALOG for alt in c.alternatives for preset in alt.identifiable_on]


@functools.cache
def _released(preset: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(prompts, fp32 logprobs, fp64 logprobs) of the unchanged oracle."""
    ids = prompts(get_preset(preset))
    return ids, logprobs(preset, torch.float32, ids), logprobs(preset, torch.float64, ids)


def test_catalog_lists_identifiable_alternatives() -> None:
    """The catalog is not vacuous: most entries name a preset where they are identifiable, and a mutant."""
    assert len(CASES) >= 30
    assert sum(bool(c.identifiable_on) for c in CATALOG) >= 10
    assert sum(bool(c.mutants) for c in CATALOG) >= 14


@pytest.mark.parametrize(("name", "value", "preset"), CASES, ids=[f"{n}={v}@{p}" for n, v, p in CASES])
def test_alternative_moves_fp32_logprobs_far_beyond_noise_and_restores_bitwise(name: str, value: str,
                                                                               preset: str) -> None:
    """Applied to a cached fp32 oracle, the alternative moves the centred top-5 logprobs (rel-RMS) by at least
    IDENTIFIABLE_FACTOR x the fp32-vs-fp64 distance of the unchanged oracle; afterwards every logit is bit-identical
    to before."""
    ids, f32, f64 = _released(preset)
    noise = logprob_distance(f64, f32)
    with applied([parse_assignment(f"{name}={value}", get_preset(preset))]):
        moved = logprobs(preset, torch.float32, ids)
    effect = logprob_distance(f32, moved)
    assert effect >= IDENTIFIABLE_FACTOR * noise, f"{name}={value} on {preset}: {effect:.3g} vs noise {noise:.3g}"
    after = logprobs(preset, torch.float32, ids)
    assert all(torch.equal(a, b) for a, b in zip(after, f32, strict=True)), "the oracle did not come back exactly"
    assert active.active() == {}


def test_fp64_oracle_honours_applied_and_restores_on_exception() -> None:
    """A cached fp64 oracle computes with the convention inside the block (moved far beyond fp32 noise), and an
    exception raised inside leaves it exactly as before."""
    preset = "k3-tp4"
    ids, f32, f64 = _released(preset)
    assignment = parse_assignment("mla.lora_norm_eps=rms_norm_eps", get_preset(preset))
    with applied([assignment]):
        moved = logprobs(preset, torch.float64, ids)
    assert logprob_distance(f64, moved) >= IDENTIFIABLE_FACTOR * logprob_distance(f64, f32)
    with pytest.raises(RuntimeError, match="inside"), applied([assignment]):
        raise RuntimeError("inside")
    after = logprobs(preset, torch.float64, ids)
    assert all(torch.equal(a, b) for a, b in zip(after, f64, strict=True))


def test_mla_lora_norm_eps_is_both_site_conventions_together() -> None:
    """mla.lora_norm_eps computes exactly what q_a and kv_a applied one by one compute together."""
    cfg, preset = get_preset("k3-tiny"), "k3-tiny"
    ids = prompts(cfg, n=1)
    with applied([parse_assignment("mla.lora_norm_eps=rms_norm_eps", cfg)]):
        both = logprobs(preset, torch.float32, ids)
    with applied([parse_assignment(f"mla.{site}_norm_eps=rms_norm_eps", cfg) for site in ("q_a", "kv_a")]):
        pair = logprobs(preset, torch.float32, ids)
    with applied([parse_assignment("mla.q_a_norm_eps=rms_norm_eps", cfg)]):
        one = logprobs(preset, torch.float32, ids)
    assert torch.equal(both[0], pair[0]) and not torch.equal(both[0], one[0])


@pytest.mark.parametrize("preset", SYNTHETIC_PRESETS)
def test_every_applicable_knob_is_read_by_a_forward(preset: str) -> None:
    """An entry whose knob the oracle never reads would explain nothing: every knob of every convention that
    applies to the preset is read during one forward (in bf16, so the precision knobs are exercised too)."""
    cfg = get_preset(preset)
    with active.recording() as reads:
        oracle(preset, torch.bfloat16)(prompts(cfg, n=1, length=6)[0])
    needed = {k for c in CATALOG if c.applies(cfg) for k in c.knobs}
    assert needed <= reads, f"{preset}: knobs never read: {sorted(needed - reads)}"


@pytest.mark.parametrize(("text", "message"), [
    ("mla.lora_norm_eps", "expected NAME=VALUE"),
    ("=1e-5", "expected NAME=VALUE"),
    ("mla.lora_eps=1e-5", "unknown convention 'mla.lora_eps'; known: kda.l2norm_eps, mla.lora_norm_eps"),
    ("kda.gate=softplus", "not a value of kda.gate; valid: safe, plain"),
    ("router.scaling=after", "valid: after_renorm, before_renorm, none"),
    ("kda.l2norm_eps=tiny", "an eps is a number >= 0 or 'rms_norm_eps'"),
    ("kda.l2norm_eps=-1e-6", "an eps is a number >= 0"),
    ("kda.l2norm_eps=nan", "an eps is a number >= 0"),
])
def test_parse_assignment_refuses_bad_input_naming_the_valid_choices(text: str, message: str) -> None:
    """Malformed text, unknown names and bad values raise ValueError naming what would be valid."""
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_assignment(text, get_preset("k3-tiny"))


def test_parse_assignment_resolves_values_for_the_config() -> None:
    """rms_norm_eps resolves from the config (2e-5 on k3-skew-10); numbers and choices parse as written."""
    skew = get_preset("k3-skew-10")
    a = parse_assignment(" mla.lora_norm_eps = rms_norm_eps ", skew)
    assert (a.convention.name, a.value_text, a.value) == ("mla.lora_norm_eps", "rms_norm_eps", 2e-5)
    assert a.mutant == "mla.lora_norm.eps_1e5" and a.text == "mla.lora_norm_eps=rms_norm_eps (2e-05)"
    assert parse_assignment("kda.l2norm_eps=1e-5", skew).value == 1e-5
    assert parse_assignment("router.scaling=none", skew).value == "none"


@pytest.mark.parametrize(("text", "preset", "why"), [
    ("mla.q_a_norm_eps=rms_norm_eps", "kl-tiny", "no MLA q_a_layernorm"),
    ("mla.lora_norm_eps=rms_norm_eps", "kl-tiny", "no MLA q_a_layernorm"),
    ("kda.gate=plain", "kl-tiny", "no KDA gate_lower_bound"),
    ("attn_res.layer_mix_eps=1e-6", "kl-tiny", "no Block Attention Residuals"),
    ("moe.latent_norm_eps=1e-6", "kl-tiny", "no LatentMoE routed_expert_norm"),
])
def test_parse_assignment_refuses_a_site_the_config_lacks(text: str, preset: str, why: str) -> None:
    """An entry that does not apply to the checkpoint is refused with the reason."""
    with pytest.raises(ValueError, match=f"does not apply to this checkpoint: this config has {why}"):
        parse_assignment(text, get_preset(preset))


@pytest.mark.parametrize("preset", SYNTHETIC_PRESETS)
def test_applies_is_honoured_by_parse_and_alternatives(preset: str) -> None:
    """Every entry that does not apply is refused by parse_assignment and never offered by alternatives_for."""
    cfg = get_preset(preset)
    offered = {a.convention.name for a in alternatives_for(cfg)}
    for conv in CATALOG:
        if conv.applies(cfg):
            continue
        assert conv.name not in offered
        with pytest.raises(ValueError, match="does not apply"):
            parse_assignment(f"{conv.name}={conv.alternatives[0].value}", cfg)


def test_alternatives_for_leaves_out_no_ops() -> None:
    """A hard-coded 1e-5 is no alternative where rms_norm_eps is 1e-5, but is on k3-skew-10 (2e-5); precision
    entries are left out for an fp32 run and offered for a bf16 one."""
    def texts(preset: str, dtype: torch.dtype | None = None) -> set[str]:
        return {f"{a.convention.name}={a.value_text}" for a in alternatives_for(get_preset(preset), dtype)}
    assert "norm.final_norm_eps=1e-5" not in texts("k3-tiny")
    assert "norm.final_norm_eps=1e-5" in texts("k3-skew-10")
    assert "mla.softmax_precision=activation" not in texts("k3-tiny", torch.float32)
    assert "mla.softmax_precision=activation" in texts("k3-tiny", torch.bfloat16)


def test_applied_refuses_two_values_for_one_site() -> None:
    """mla.lora_norm_eps and mla.q_a_norm_eps at different values cannot both hold."""
    cfg = get_preset("k3-tiny")
    pair = [parse_assignment("mla.lora_norm_eps=rms_norm_eps", cfg), parse_assignment("mla.q_a_norm_eps=1e-7", cfg)]
    with pytest.raises(ValueError, match="set mla.q_a_norm_eps to different values"), applied(pair):
        pass
    assert active.active() == {}


def test_by_name_lists_known_names() -> None:
    """by_name finds an entry and raises KeyError listing the catalog otherwise."""
    assert by_name("kda.gate").released == "safe"
    with pytest.raises(KeyError, match="unknown convention 'kda.gates'; known: kda.l2norm_eps"):
        by_name("kda.gates")


def test_released_values_are_the_oracle_constants() -> None:
    """The catalog's released values are the oracle's own constants, and every entry is written up in
    docs/conventions.md (which functional.py's constants point to)."""
    cfg = get_preset("k3-tiny")
    for name, constant in (("kda.l2norm_eps", Fn.L2NORM_EPS), ("mla.lora_norm_eps", Fn.MLA_LORA_EPS),
                           ("router.renorm_eps", Fn.RENORM_EPS)):
        assert by_name(name).released_value(cfg) == constant
    doc = DOC.read_text()
    missing = [c.name for c in CATALOG if f"`{c.name}`" not in doc]
    assert not missing, f"docs/conventions.md does not describe {missing}"
    assert "docs/conventions.md" in Path(Fn.__file__).read_text()


def test_assignment_of_an_uncatalogued_value_has_no_mutant() -> None:
    """A value the catalog does not list is still applied, but claims no alternative and no mutant."""
    a = parse_assignment("kda.l2norm_eps=3e-6", get_preset("kl-tiny"))
    assert isinstance(a, Assignment) and a.alternative is None and a.mutant is None and a.value == 3e-6


def test_every_named_mutant_is_in_the_mutation_catalog() -> None:
    """A mutant id the catalog names must exist in k3verify/mutations/: the endpoint tests inject it into our server."""
    from k3verify.gates.mutation.runner import load_catalog

    known = {m.id for m in load_catalog()}
    named = [m for c in CATALOG for m in c.mutants]
    assert named and not sorted(set(named) - known), f"unknown mutants: {sorted(set(named) - known)}"
