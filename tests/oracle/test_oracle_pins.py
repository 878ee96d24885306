"""Pinning: today's oracle files match pins.json, and a changed hash is reported, not ignored."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from k3verify.oracle import pinning
from k3verify.oracle.pinning import report_pins


def test_installed_oracle_matches_committed_pins() -> None:
    """Versions and sha256 of every oracle source file equal pins.json (rerun --write after a deliberate edit)."""
    assert pinning.mismatches(pinning.oracle_provenance()) == []


def test_altered_pin_is_reported_as_mismatch() -> None:
    """Control: one altered sha256 and one altered version each produce a mismatch line."""
    pins = copy.deepcopy(pinning.load_pins())
    path = next(iter(pins["fla"]["files"]))
    pins["fla"]["files"][path] = "0" * 64
    pins["transformers"]["version"] = "0.0.0"
    lines = pinning.mismatches(pinning.oracle_provenance(pins))
    assert any(path in line for line in lines) and any("transformers: version" in line for line in lines)
    assert len(lines) == 2


def test_provenance_shape_and_report_adapter() -> None:
    """{name: {version, pinned_version, files: {path: {sha256, pinned_sha256, matches}}}} for the report."""
    prov = pinning.oracle_provenance()
    assert set(prov) == {"transformers", "fla", "k3verify.oracle"}
    entry = prov["transformers"]["files"]["models/kimi_linear/modeling_kimi_linear.py"]
    assert set(entry) == {"sha256", "pinned_sha256", "matches"} and entry["matches"]
    assert report_pins()["mismatches"] == []


def test_write_pins_round_trips(tmp_path: Path) -> None:
    """--write output re-reads to the same provenance with every file matching."""
    out = tmp_path / "pins.json"
    pinning.write_pins(out)
    assert pinning.mismatches(pinning.oracle_provenance(json.loads(out.read_text()))) == []
