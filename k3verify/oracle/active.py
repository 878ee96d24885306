"""Which conventions the oracle computes with right now.

The oracle's modules read every constant that public implementations disagree on (an eps, a routing form, a
precision) through `current(knob, released)` at forward time, never at construction, so a model built and cached
before `overriding(...)` is entered still honours it. Outside any `overriding` block every knob reads its
released value. The state is one module-level dict: entering blocks from two threads at once is not supported.
Which knobs exist, and what their values mean, is the catalog's business (oracle/conventions.py,
oracle/precision.py, docs/conventions.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_ACTIVE: dict[str, Any] = {}
_READS: list[set[str]] = []  # open `recording` blocks: a knob the oracle never reads would be a catalog entry
# that changes nothing, so tests record which knobs a forward reads


def current(knob: str, released: T) -> T:
    """The value `knob` has inside the innermost `overriding` block that sets it, else `released`."""
    for reads in _READS:
        reads.add(knob)
    value: T = _ACTIVE.get(knob, released)
    return value


def in_activation(knob: str) -> bool:
    """A precision knob: "float32" (the released code's fp32 step) or "activation" (that step in the activation
    dtype instead, a no-op in an fp32 or fp64 run)."""
    value = current(knob, "float32")
    if value not in ("float32", "activation"):
        raise ValueError(f"{knob} must be 'float32' or 'activation'; got {value!r}")
    return value == "activation"


def active() -> dict[str, Any]:
    """A copy of the knobs set right now (empty outside every `overriding` block)."""
    return dict(_ACTIVE)


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """Collect the names of the knobs read inside the block."""
    reads: set[str] = set()
    _READS.append(reads)
    try:
        yield reads
    finally:
        _READS.remove(reads)


@contextlib.contextmanager
def overriding(values: Mapping[str, Any]) -> Iterator[None]:
    """Set `values` (knob -> value) for the block; blocks nest, and on exit (exceptions included) every knob
    reads exactly what it read before."""
    saved = dict(_ACTIVE)
    _ACTIVE.update(values)
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(saved)
