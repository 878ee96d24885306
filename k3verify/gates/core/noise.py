"""RMS bars from measured noise: a bar is a multiple of the distance between two references.

A check's noise is the relative RMS distance between the same reference computed at the check's
precision and in fp64, on the check's own inputs: a module check runs the oracle's module in fp32 (or
bf16) and in fp64; a whole-model check runs the oracle in fp32 and fp64 under the same route pinning it
applies to the candidate. No serving code takes part, so a bug cannot widen its own bar.

    bar = max(FACTOR x noise, FLOOR_ROUNDINGS x unit roundoff of the check's dtype)

FACTOR = 4: the candidate and the reference each sit about `noise` from the fp64 result, so two correct
results can be 2x noise apart (triangle inequality); the other 2x lets the candidate's op order be up to
twice as inexact as the reference's (measured on the synthetic presets: 0.3x to 1.3x). The floor only
matters when a reference is (nearly) exact at the check's precision: two correct results that differ in
one rounding of each output sit up to 2 unit roundoffs apart per element, and the floor doubles that.
A bar that ends up more than MAX_OVER_NOISE x its noise (only possible through the floor) carries the
floor's reason in its derivation.

Presets record their noise in noise.json (written by tools/measure_noise.py, on CPU at seed 0, keyed
by the synthetic checkpoint's digest). Every other run (a user checkpoint, another device kind, another
seed, a preset whose bytes changed) measures the noise at run time from the pair the check supplies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from k3verify.gates.core.compare import rel_rms_error

if TYPE_CHECKING:
    from k3verify.target import Target

FACTOR = 4.0
FLOOR_ROUNDINGS = 4
MAX_OVER_NOISE = 100.0
OBSERVED_DRIFT = 2.0  # a recorded noise this far from the run's own measurement is reported as stale
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
FLOOR_REASON = ("the reference is (nearly) exact at this precision; two correct results still differ by one "
                "rounding of each output, so no bar sits below 4 unit roundoffs")
RECORDING = Path(__file__).with_name("noise.json")
RECORDED_DEVICE, RECORDED_SEED = "cpu", 0


class NoiseError(RuntimeError):
    """A noise-derived bar that cannot be resolved (no recording and no pair, or a non-finite noise)."""


@dataclass(frozen=True)
class NoiseLookup:
    """What the recording holds for one check of this run: a value, or why it holds none."""

    value: float | None
    dtype: str | None
    why_not: str | None


def floor_for(dtype: str) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise NoiseError(f"no unit roundoff known for dtype {dtype!r}; expected one of {sorted(UNIT_ROUNDOFF)}")
    return FLOOR_ROUNDINGS * UNIT_ROUNDOFF[dtype]


def derive_bar(noise: float, dtype: str) -> tuple[float, str]:
    """(bar, one-line derivation) for a measured relative-RMS noise at `dtype`."""
    if not (math.isfinite(noise) and noise >= 0.0):
        raise NoiseError(f"measured noise must be a finite number >= 0; got {noise!r}")
    floor = floor_for(dtype)
    bar = max(FACTOR * noise, floor)
    text = (f"bar = max({FACTOR:g} x noise {noise:.3g}, floor {floor:.3g} = {FLOOR_ROUNDINGS} {dtype} unit "
            f"roundoffs) = {bar:.3g}")
    if noise == 0.0 or bar > MAX_OVER_NOISE * noise:
        text += f"; more than {MAX_OVER_NOISE:g}x the noise through the floor: {FLOOR_REASON}"
    return bar, text


def dtype_of(value: Any) -> str:
    """The dtype name of a tensor, or of the first tensor of a dict of tensors."""
    if isinstance(value, Mapping):
        if not value:
            raise NoiseError("an empty dict as a noise side")
        return dtype_of(next(iter(value.values())))
    if not isinstance(value, torch.Tensor):
        raise NoiseError(f"a noise side must be a Tensor or a dict of Tensors; got {type(value).__name__}")
    return str(value.dtype).removeprefix("torch.")


def measure(pair: tuple[Any, Any]) -> tuple[float, str]:
    """(relative RMS of pair[0] from pair[1], dtype of pair[0]): pair = (reference at the check's precision,
    the same reference in fp64)."""
    low, high = pair
    value = rel_rms_error(high, low)
    if not math.isfinite(value):
        raise NoiseError(f"the noise pair is non-finite or mismatched (relative RMS {value})")
    return value, dtype_of(low)


@cache
def load_recording(path: Path = RECORDING) -> dict[str, Any]:
    if not path.is_file():
        return {"presets": {}}
    return json.loads(path.read_text(encoding="utf-8"))


def lookup(target: Target, device_kind: str, seed: int, check_id: str,
           recording: Mapping[str, Any] | None = None) -> NoiseLookup:
    """The recorded noise of `check_id` for this run, or why none applies (then it is measured at run time)."""
    data = load_recording() if recording is None else recording
    if target.preset is None:
        return NoiseLookup(None, None, "a checkpoint target: noise is measured at run time")
    entry = data.get("presets", {}).get(target.preset)
    if entry is None:
        return NoiseLookup(None, None, f"no recording for preset {target.preset!r}")
    if entry.get("digest") != target.digest:
        return NoiseLookup(None, None, f"recording for {target.preset!r} is of checkpoint digest "
                                       f"{str(entry.get('digest'))[:12]}, this one is {target.digest[:12]}")
    if device_kind != entry.get("device") or seed != entry.get("seed"):
        return NoiseLookup(None, None, f"recorded on {entry.get('device')} at seed {entry.get('seed')}; "
                                       f"this run: {device_kind}, seed {seed}")
    check = entry.get("checks", {}).get(check_id)
    if check is None:
        return NoiseLookup(None, None, f"no recorded noise for {check_id} on {target.preset!r}")
    return NoiseLookup(float(check["noise"]), str(check["dtype"]), None)


def resolve(check_id: str, pair_text: str, found: NoiseLookup | None,
            pair: tuple[Any, Any] | None) -> tuple[float, dict[str, Any]]:
    """(bar, the report's noise record) from the recording, else from the pair the check measured."""
    observed = measure(pair) if pair is not None else None
    if found is not None and found.value is not None and found.dtype is not None:
        value, dtype, source = found.value, found.dtype, "recorded"
    elif observed is not None:
        value, dtype, source = observed[0], observed[1], "measured"
    else:
        why = found.why_not if found is not None else "no recording was looked up"
        raise NoiseError(f"{check_id}: its bar derives from measured noise ({pair_text}), but {why} and the check "
                         "returned no noise pair")
    bar, derivation = derive_bar(value, dtype)
    note = None
    if source == "recorded" and observed is not None and not _close(value, observed[0]):
        note = (f"this run measured noise {observed[0]:.3g}, recorded {value:.3g}: the recording looks stale "
                "(regenerate with tools/measure_noise.py)")
    record = {"value": value, "dtype": dtype, "source": source, "pair": pair_text, "factor": FACTOR,
              "floor": floor_for(dtype), "derivation": derivation,
              "observed": None if observed is None else observed[0],
              "why_measured": None if source == "recorded" or found is None else found.why_not, "note": note}
    return bar, record


def _close(a: float, b: float) -> bool:
    lo, hi = min(a, b), max(a, b)
    return hi <= OBSERVED_DRIFT * lo or hi - lo <= 1e-12
