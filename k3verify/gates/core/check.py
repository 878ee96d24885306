"""What a check is (Check, Trial, CheckContext), what it produces (Result), and the registry.

Checks register at import time through `register_check`; the spec is validated there so that a
bad bar, a missing justification or a duplicate id fails loudly before anything runs.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from k3verify.gates.core.compare import Kind, WorstElement, default_bar
from k3verify.gates.core.noise import NoiseLookup

if TYPE_CHECKING:  # the check engine itself runs without a model (gates/core/suite.py)
    from k3verify.config import ModelConfig
    from k3verify.endpoint.session import EndpointSession
    from k3verify.target import Target

COMPONENTS = frozenset({
    "kda", "mla", "moe", "mlp", "attn_res", "router", "norm", "tokenizer", "weights", "model", "serving",
    "kernel", "oracle", "gates", "endpoint",
})
LEVELS = frozenset({"module", "model", "serving", "kernel"})
SUITES = frozenset({"quick", "full"})
DEVICES = frozenset({"cpu", "cuda"})
_ID_RE = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")


class Status(enum.StrEnum):
    PASS = "pass"
    EXCUSED = "excused"  # a pass only after rounding near-ties were excused (gates/core/excused.py)
    FAIL = "fail"
    VACUOUS = "vacuous"
    ERROR = "error"
    SKIPPED = "skipped"



class SkipCheck(Exception):
    """The check does not apply here (feature absent in this preset, needs CUDA). Never hides a failure."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


LayerTrace = list[tuple[str, Any, Any]]


@dataclass
class Trial:
    """What a check returns: the same function computed three ways (see docs/CHECK-API.md)."""

    reference: Any
    candidate: Any
    control: Any
    gold: Any = None
    layers: LayerTrace | None = None
    position_dim: int | None = None
    control_layers: LayerTrace | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    noise: tuple[Any, Any] | None = None  # (reference at the check's precision, the same reference in fp64)
    bar: float | None = None  # RMS only: a bar measured in this run (see evaluate_trial); the registered bar caps it


@dataclass
class CheckContext:
    """Everything a check may use. `generator` is a CPU generator, fresh per check and seeded from
    (seed, check id): draw inputs on CPU, then move them to `device`, so inputs match across devices.
    `dtype` is the serving dtype the run covers; checks of the served model use it (builders.served_model)."""

    target: Target
    device: torch.device
    seed: int
    generator: torch.Generator
    suite: str
    cache: dict[str, Any] = field(default_factory=dict)
    endpoint: EndpointSession | None = None  # `parity --endpoint`: the server under test
    dtype: torch.dtype = torch.bfloat16  # the serving dtype under test (`parity --dtype`)
    level: str = ""  # the running check's level: model/serving-level use of a serving model counts as coverage
    parallel: tuple[int, int] | None = None  # (tp, ep) the dist.* checks run; None: their default world
    noise: NoiseLookup | None = None  # the recorded noise of a noise-barred check (gates/core/noise.py)
    serving_dtypes: set[str] = field(default_factory=set)  # dtypes this check built the served model in (builders)
    run_notes: list[str] = field(default_factory=list)  # how the check ran (a streamed oracle, a slice): its notes
    # the same check on a slice of the model (gates/shared/slice.py), for the runner when the check skips for size
    slicer: Callable[[CheckContext], tuple[CheckContext, str]] | None = None

    @property
    def needs_noise(self) -> bool:
        """True when this check's bar derives from noise that is not recorded for this run: the check
        must return Trial.noise, measured on its own inputs."""
        return self.noise is not None and self.noise.value is None

    @property
    def cfg(self) -> ModelConfig:
        return self.target.cfg

    @property
    def preset(self) -> str | None:
        return self.target.preset

    @property
    def checkpoint_dir(self) -> Path:
        return self.target.checkpoint_dir


CheckFn = Callable[[CheckContext], Trial]


@dataclass(frozen=True)
class Check:
    """A registered check spec. `bar` is the effective bar (defaults filled in)."""

    id: str
    component: str
    level: str
    kind: Kind
    bar: float | None
    bar_reason: str | None
    suites: tuple[str, ...]
    control: str
    fn: CheckFn
    devices: tuple[str, ...] = ("cpu", "cuda")
    noise: str | None = None  # the two references whose distance derives the bar (gates/core/noise.py)

    @property
    def module(self) -> str:
        return getattr(self.fn, "__module__", "?")

    @property
    def bar_source(self) -> str:
        """noise (derived per run), fixed (a justified constant), format (the bf16 tolerance), none (bit-exact)."""
        if self.noise is not None:
            return "noise"
        return {Kind.RMS: "fixed", Kind.BF16: "format", Kind.BITEXACT: "none"}[self.kind]


@dataclass
class ControlOutcome:
    status: str  # "fail" is what we want: the control must be caught
    description: str
    metric: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    first_divergent_layer: str | None = None


@dataclass
class Result:
    id: str
    component: str
    level: str
    kind: str
    bar: float | None
    bar_reason: str | None
    status: Status
    reason: str | None = None
    metric: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    per_key: dict[str, dict[str, Any]] = field(default_factory=dict)
    control: ControlOutcome | None = None
    margin: float | None = None
    thin: bool = False
    worst: WorstElement | None = None
    shapes: dict[str, list[int]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    seed: int | None = None
    duration_s: float = 0.0
    localization: dict[str, Any] | None = None
    instrument: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    traceback: str | None = None
    bar_source: str = "none"
    noise: dict[str, Any] | None = None
    serving_dtypes: list[str] = field(default_factory=list)  # what the run's `dtypes` is recomputed from

    @property
    def failed(self) -> bool:
        return self.status in (Status.FAIL, Status.VACUOUS, Status.ERROR)


class Registry:
    """Check id -> Check. One global instance (REGISTRY); tests may build their own."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}

    def add(self, check: Check) -> Check:
        existing = self._checks.get(check.id)
        if existing is not None and _origin(existing.fn) != _origin(check.fn):
            raise ValueError(f"duplicate check id {check.id!r}: registered by {_origin(existing.fn)} "
                             f"and again by {_origin(check.fn)}")
        # Same function object origin = the same module imported twice (reload); keep the newest.
        self._checks[check.id] = check
        return check

    def register_check(self, **spec: Any) -> Callable[[CheckFn], CheckFn]:
        def decorate(fn: CheckFn) -> CheckFn:
            self.add(make_check(fn, **spec))
            return fn
        return decorate

    def get(self, check_id: str) -> Check:
        return self._checks[check_id]

    def __contains__(self, check_id: object) -> bool:
        return check_id in self._checks

    def __iter__(self) -> Iterator[Check]:
        return iter(sorted(self._checks.values(), key=lambda c: c.id))

    def __len__(self) -> int:
        return len(self._checks)


def _origin(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def make_check(
    fn: CheckFn,
    *,
    id: str,
    component: str,
    level: str,
    kind: Kind | str,
    control: str,
    bar: float | None = None,
    bar_reason: str | None = None,
    suites: tuple[str, ...] | list[str] = ("quick", "full"),
    devices: tuple[str, ...] | list[str] = ("cpu", "cuda"),
    noise: str | None = None,
) -> Check:
    """Validate a spec and build the Check. Every rejection names the field and the value."""
    where = f"check {id!r} ({_origin(fn)})"
    if not isinstance(id, str) or not _ID_RE.match(id):
        raise ValueError(f"{where}: id must be dotted lower_snake like 'kda.conv.packed_boundary'; got {id!r}")
    if component not in COMPONENTS:
        raise ValueError(f"{where}: component must be one of {sorted(COMPONENTS)}; got {component!r}")
    if level not in LEVELS:
        raise ValueError(f"{where}: level must be one of {sorted(LEVELS)}; got {level!r}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ValueError(f"{where}: kind must be one of {[k.value for k in Kind]}; got {kind!r}") from None
    if not isinstance(control, str) or not control.strip():
        raise ValueError(f"{where}: control must say in one sentence what the control breaks; got {control!r}")
    suites, devices = tuple(suites), tuple(devices)
    if not suites or not set(suites) <= SUITES:
        raise ValueError(f"{where}: suites must be a non-empty subset of {sorted(SUITES)}; got {suites!r}")
    if not devices or not set(devices) <= DEVICES:
        raise ValueError(f"{where}: devices must be a non-empty subset of {sorted(DEVICES)}; got {devices!r}")
    if noise is not None:
        if kind is not Kind.RMS or bar is not None or bar_reason is not None:
            raise ValueError(f"{where}: noise= derives an RMS bar; it takes kind RMS and no bar or bar_reason "
                             f"(got kind={kind.value}, bar={bar}, bar_reason={bar_reason!r})")
        if not (isinstance(noise, str) and noise.strip()):
            raise ValueError(f"{where}: noise must name the two references whose distance is the noise; got {noise!r}")
    elif kind is Kind.RMS and bar is None:
        raise ValueError(f"{where}: an RMS check needs noise=<the two references> (bar derived from measured "
                         "noise) or bar=<value> with a bar_reason")
    if bar is not None:
        if kind is not Kind.RMS:
            raise ValueError(f"{where}: only RMS checks take a bar; {kind.value} bars are fixed (got bar={bar})")
        if not (isinstance(bar, int | float) and 0.0 < float(bar) < float("inf")):
            raise ValueError(f"{where}: bar must be a positive finite number; got {bar!r}")
        if not (isinstance(bar_reason, str) and bar_reason.strip()):
            raise ValueError(f"{where}: an RMS bar override ({bar}) needs a one-line bar_reason")
        bar = float(bar)
    elif bar_reason is not None:
        raise ValueError(f"{where}: bar_reason given without a bar override")
    effective = bar if bar is not None or noise is not None else default_bar(kind)
    return Check(id, component, level, kind, effective, bar_reason, suites, control.strip(), fn, devices,
                 None if noise is None else noise.strip())


REGISTRY = Registry()


def register_check(**spec: Any) -> Callable[[CheckFn], CheckFn]:
    """Decorator registering a check in the global REGISTRY (see docs/CHECK-API.md)."""
    return REGISTRY.register_check(**spec)
