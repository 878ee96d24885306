"""Adapter for `k3verify parity`'s report contract: `oracle_pins() -> dict` (see commands/parity.py)."""

from __future__ import annotations

from typing import Any

from k3verify.oracle.pinning import mismatches, oracle_provenance


def oracle_pins() -> dict[str, Any]:
    """oracle_provenance() plus a `mismatches` list (empty when every version and file matches its pin)."""
    provenance = oracle_provenance()
    return {"sources": provenance, "mismatches": mismatches(provenance)}
