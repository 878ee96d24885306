"""Rounding near-ties of an emulated precision: the Q8_0 roundings a correct implementation may take either way.

Under w4a8-q8act every routed-expert matmul input is rounded to Q8_0 codes (functional.q8_0_codes). A scaled
product that sits nearer a rounding boundary (k + 1/2) than the fp32 arithmetic before it can place it is a coin
toss: an implementation computing the same model in fp32 with another reduction order takes the other code about
as often as not, and one code step in an early MoE layer moves everything after it far beyond the fp32 noise the
endpoint bars are measured from. Such a rounding is a near-tie when its distance from the boundary, in the gold
run, is within a factor of the distance between the base (declared dtype) and gold values at the same site (their
RMS over everything that MoE layer rounds at that stage): the caller grants the endpoint the same factor of the
oracle's own noise on the values it rounds as on its outputs.

A `Ledger` made active around an oracle forward (`recording`) records the scaled products of every emulated
rounding by site and forces the codes it was given; `near_ties(base, gold)` lists the near-ties of two recorded
runs. Not thread-safe, like oracle/active.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from k3verify.oracle import functional as Fn

INPUT, DOWN = "input", "down"


@dataclass(frozen=True, order=True)
class Site:
    """One rounded value: MoE layer index, token position, stage (INPUT: the routed experts' gate/up input, the
    same row for every expert of the token, expert -1; DOWN: one expert's down input) and element index."""

    layer: int
    token: int
    stage: str
    expert: int
    element: int

    def describe(self) -> str:
        where = "the routed experts' input" if self.stage == INPUT else f"expert {self.expert}'s down input"
        return f"layer {self.layer} {where}, token {self.token}, element {self.element}"


@dataclass(frozen=True)
class NearTie:
    site: Site
    scaled: float  # the gold's scaled product x · 127/max|x| before rounding
    code: int  # the gold's code
    other: int  # the code across the boundary
    distance: float  # |scaled - boundary|
    window: float  # factor x the site's base-vs-gold RMS
    factor: float

    def describe(self) -> str:
        return (f"{self.site.describe()}: the gold's scaled value {self.scaled:.6f} is {self.distance:.2g} from the "
                f"rounding boundary, within {self.window:.2g} ({self.factor:g} x the layer's base-vs-gold RMS there); "
                f"code {self.other} instead of {self.code}")


@dataclass
class Ledger:
    """Scaled products of every emulated rounding, (layer, token, stage, expert) -> [K] float64; `forced`: codes
    to use instead of the computed ones at these sites; `used`: the forced sites that a forward reached."""

    forced: Mapping[Site, int] = field(default_factory=dict)
    rows: dict[tuple[int, int, str, int], torch.Tensor] = field(default_factory=dict)
    used: set[Site] = field(default_factory=set)


_ACTIVE: list[Ledger] = []


@contextlib.contextmanager
def recording(ledger: Ledger) -> Iterator[Ledger]:
    """Every emulated rounding inside is recorded into `ledger`, and its forced codes applied."""
    _ACTIVE.append(ledger)
    try:
        yield ledger
    finally:
        _ACTIVE.remove(ledger)


def q8_0_round(x: torch.Tensor, layer: int, stage: str, expert: int, tokens: Sequence[int]) -> torch.Tensor:
    """functional.q8_0_round of rows x [n, K], row r being token tokens[r] at (layer, stage, expert); recorded into
    the active ledger (if any), with its forced codes in place of the computed ones."""
    if not _ACTIVE:
        return Fn.q8_0_round(x)
    if stage not in (INPUT, DOWN):
        raise ValueError(f"stage must be {INPUT!r} or {DOWN!r}; got {stage!r}")
    if x.dim() != 2 or x.shape[0] != len(tokens):
        raise ValueError(f"expected rows [{len(tokens)}, K] for {len(tokens)} tokens; got {tuple(x.shape)}")
    ledger, who = _ACTIVE[-1], -1 if stage == INPUT else expert
    scaled, q, d = Fn.q8_0_codes(x)
    flat_scaled, codes = scaled.reshape(x.shape[0], -1), q.reshape(x.shape[0], -1).clone()
    for r, token in enumerate(tokens):
        ledger.rows[(layer, token, stage, who)] = flat_scaled[r].double().clone()
    row_of = {token: r for r, token in enumerate(tokens)}
    for site, code in ledger.forced.items():
        if (site.layer, site.stage, site.expert) == (layer, stage, who) and site.token in row_of:
            codes[row_of[site.token], site.element] = float(code)
            ledger.used.add(site)
    return Fn.q8_0_value(codes.reshape(q.shape), d, x)


def near_ties(base: Ledger, gold: Ledger, factor: float) -> list[NearTie]:
    """The roundings of the gold run within `factor` x their site's base-vs-gold RMS of a boundary, not already
    forced, most ambiguous (distance / window) first. A site is one MoE layer's stage: the RMS is over every value
    it rounds in the sequence, a steadier measure of how far the arithmetic before it moves these values than one
    row's. Rows the two runs did not both compute (a router choice that differs between them) are left out."""
    shared = [key for key, g in gold.rows.items() if key in base.rows and base.rows[key].shape == g.shape]
    by_site: dict[tuple[int, str], list[torch.Tensor]] = {}
    for key in shared:
        by_site.setdefault((key[0], key[2]), []).append(base.rows[key] - gold.rows[key])
    windows = {site: factor * float(torch.cat(diffs).pow(2).mean().sqrt()) for site, diffs in by_site.items()}
    ties: list[NearTie] = []
    for key in shared:
        g, window = gold.rows[key], windows[(key[0], key[2])]
        distance = (g - g.floor() - 0.5).abs()
        for element in (distance <= window).nonzero().flatten().tolist():
            site = Site(key[0], key[1], key[2], key[3], int(element))
            if site in gold.forced:
                continue
            value = float(g[element])
            code = int(torch.tensor(value).round())  # half to even, as the rounding itself
            other = math.floor(value) if code > value else math.ceil(value)
            ties.append(NearTie(site, value, code, other, float(distance[element]), window, factor))
    return sorted(ties, key=lambda t: (t.distance / t.window, t.site))
