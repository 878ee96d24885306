"""Every catalog convention with a mutant is named first when it is injected into our own server: the mutant runs
through the mutate machinery (a patched package copy serving over HTTP), `parity --endpoint self` fails on it, and
the explanation's first tie group holds exactly that convention. One server per entry, on a preset where the entry
is identifiable. CI runs CI_ENTRIES; K3V_ALL_CONVENTIONS=1 runs every entry (docs/conventions.md records the last
full run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3verify.gates.mutation.runner import DEFAULT_CATALOG, load_catalog, run_child
from k3verify.gates.shared.explain import MIN_EXPLAINED
from k3verify.oracle.conventions import CATALOG

PREFERRED = ("kl-tiny", "k3-tiny", "k3-tp4", "k3-skew-10", "k3-syn-25")  # cheapest first
CI_ENTRIES = {"mla.kv_a_norm_eps", "kda.conv_activation", "router.scaling", "mla.lora_norm_eps"}
CASES = [(c.name, a.value, a.mutant, next(p for p in PREFERRED if p in a.identifiable_on))
         for c in CATALOG for a in c.alternatives if a.mutant and a.identifiable_on]


@pytest.mark.parametrize(("name", "value", "mutant_id", "preset"), CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_an_injected_convention_is_explained_first(name: str, value: str, mutant_id: str, preset: str,
                                                   tmp_path: Path) -> None:
    """The mutant's server fails an output check and the explanation names `name=value` in its first tie group,
    removing at least half of the distance (a mutant may inject the convention at fewer sites than the oracle
    applies it: attn_res.eps.layer_mix leaves 30% on k3-syn-25)."""
    if name not in CI_ENTRIES and os.environ.get("K3V_ALL_CONVENTIONS") != "1":
        pytest.skip(f"{name}={value}: outside CI's set; K3V_ALL_CONVENTIONS=1 runs it")
    mutant = {m.id: m for m in load_catalog(DEFAULT_CATALOG)}[mutant_id]
    child = run_child(mutant, preset, ["endpoint.greedy.tokens", "endpoint.logprobs.topk"],
                      catalog_dir=DEFAULT_CATALOG, cache_dir=tmp_path / "cache", seed=0, threads=1, timeout_s=600)
    assert child.report is not None, child.output[-2000:]
    red = [r["id"] for r in child.report["results"] if r["status"] == "fail"]
    assert red, f"{mutant_id} on {preset} failed no output check"
    explanation = child.report["run"]["endpoint"]["explanation"]
    first = [c["assignment"].split(" ")[0] for c in explanation["groups"][0]]
    assert f"{name}={value}" in first, explanation["headline"]
    assert explanation["groups"][0][0]["explained"] >= MIN_EXPLAINED, explanation["headline"]
    assert explanation["headline"].startswith("best explained by"), explanation["headline"]
