"""A pass with excused rounding near-ties is its own status ("excused"), shown as "pass, N roundings excused".

A logprob check at an emulated precision may pass only after excusing rounding near-ties the endpoint took the
other way (gates/shared/endpoint_oracle.py `resolve_roundings`); it reports how many in its metrics
(EXCUSED_METRIC), and the gate rule (gates/core/evaluate.py `status_of`, re-applied by `serve`) makes such a pass
"excused". The verdict counts it as a pass (gates/core/binding.py); every format names the count, never a plain pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

EXCUSED = "excused"
EXCUSED_METRIC = "excused_rounding_near_ties"  # the metric a check reports its excused roundings in


def excused_count(metrics: Mapping[str, Any]) -> int:
    """How many rounding near-ties a result's metrics say were excused (0 when none)."""
    value = metrics.get(EXCUSED_METRIC, 0)
    return int(value) if isinstance(value, int | float) and math.isfinite(value) else 0


def status_label(status: str, metrics: Mapping[str, Any]) -> str:
    """How every format shows a status: an excused pass names its count, never a plain pass."""
    if status == EXCUSED:
        n = excused_count(metrics)
        return f"pass, {n} rounding{'s' if n != 1 else ''} excused"
    return status
