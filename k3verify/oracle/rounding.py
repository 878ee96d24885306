"""Rounding near-ties of an emulated precision: the Q8_0 roundings a correct implementation may take either way.

Under w4a8-q8act every routed-expert matmul input is rounded to Q8_0 codes (functional.q8_0_codes), and each
block's scale max|x|/127 to fp16: a rounding too, recorded in units of its fp16 step (stage + SCALE). A scaled
product that sits nearer a rounding boundary (k + 1/2) than the fp32 arithmetic before it can place it is a coin
toss: an implementation computing the same model in fp32 with another reduction order takes the other code about
as often as not, and one code step in an early MoE layer moves everything after it far beyond the fp32 noise the
endpoint bars are measured from. Such a rounding is a near-tie when its distance from the boundary, in the gold
run, is within a factor of the distance between the base (declared dtype) and gold values at the same site (their
RMS over everything that MoE layer rounds at that stage): the caller grants the endpoint the same factor of the
oracle's own noise on the values it rounds as on its outputs.

A `Ledger` made active around an oracle forward (`recording`) records the scaled products and the codes of every
emulated rounding by site, forces the codes it was given, and may follow another run's codes (`follow`: the
declared-precision run computing with the gold's codes, whose distance from the gold is the arithmetic's own
noise without any coin toss in it). `near_ties(base, gold)` lists the near-ties of two recorded runs: the window is
measured only on rows before the two runs first diverge (`clean_rows`) and never exceeds WINDOW_CAP of a step;
`expected_flips` is how many roundings an implementation with that much noise is expected to take the other way.
Not thread-safe, like oracle/active.py.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from k3verify.oracle import functional as Fn

INPUT, DOWN = "input", "down"
SCALE = ".scale"  # a stage's block scales: d = fp16(max|x|/127), a rounding of its own (in units of its fp16 step)
STAGE_ORDER = {INPUT: 0, INPUT + SCALE: 0, DOWN: 1, DOWN + SCALE: 1}  # the input is rounded before the down input
# No window reaches past this share of a Q8_0 step: the one tie a real implementation (llama.cpp) took the other
# way sat 2.0e-4 of a step from its boundary, while windows measured where two runs had already diverged reached
# 0.12-0.83 of a step (at 0.5 every rounding is a "near-tie")
WINDOW_CAP = 1e-3
Key = tuple[int, int, str, int]  # (layer, token, stage, expert)


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
        where = "the routed experts' input" if self.stage.startswith(INPUT) else f"expert {self.expert}'s down input"
        if self.stage.endswith(SCALE):
            return f"layer {self.layer} {where}, token {self.token}, the fp16 scale of block {self.element}"
        return f"layer {self.layer} {where}, token {self.token}, element {self.element}"


@dataclass(frozen=True)
class NearTie:
    site: Site
    scaled: float  # the gold's scaled product x · 127/max|x| before rounding
    code: int  # the gold's code
    other: int  # the code across the boundary
    distance: float  # |scaled - boundary|
    window: float  # min(factor x the site's base-vs-gold RMS before the runs diverge, WINDOW_CAP)
    factor: float

    def describe(self) -> str:
        return (f"{self.site.describe()}: the gold's scaled value {self.scaled:.6f} is {self.distance:.2g} from the "
                f"rounding boundary, within {self.window:.2g} ({self.factor:g} x the layer's base-vs-gold RMS there, "
                f"at most {WINDOW_CAP:g} of a step); code {self.other} instead of {self.code}")


@dataclass
class Ledger:
    """Scaled products of every emulated rounding, (layer, token, stage, expert) -> [K] float64, and the codes it
    took there (`codes`, [K] float); `forced`: codes to use instead of the computed ones at these sites; `used`: the
    forced sites that a forward reached; `follow`: a recorded run whose codes are taken at every row it rounded
    too (the forced ones still win)."""

    forced: Mapping[Site, int] = field(default_factory=dict)
    rows: dict[Key, torch.Tensor] = field(default_factory=dict)
    codes: dict[Key, torch.Tensor] = field(default_factory=dict)
    used: set[Site] = field(default_factory=set)
    follow: Ledger | None = None


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
    position, step = scale_steps(x)  # [n, K/32]: max|x|/127 in units of its fp16 step, and that step
    stages = {stage: (scaled.reshape(x.shape[0], -1), q.reshape(x.shape[0], -1).clone()),
              stage + SCALE: (position, position.round())}
    row_of = {token: r for r, token in enumerate(tokens)}
    for name, (values, codes) in stages.items():
        for r, token in enumerate(tokens):
            key = (layer, token, name, who)
            ledger.rows[key] = values[r].double().clone()
            followed = ledger.follow.codes.get(key) if ledger.follow is not None else None
            if followed is not None and followed.shape == codes[r].shape:
                codes[r] = followed.to(codes.dtype)
        for site, code in ledger.forced.items():
            if (site.layer, site.stage, site.expert) == (layer, name, who) and site.token in row_of:
                codes[row_of[site.token], site.element] = float(code)
                ledger.used.add(site)
        for r, token in enumerate(tokens):
            ledger.codes[(layer, token, name, who)] = codes[r].clone()
    scale_codes = stages[stage + SCALE][1]
    moved = scale_codes != position.round()  # scales taken from another run or forced: code x this run's step
    d = torch.where(moved.reshape(d.shape), (scale_codes * step).reshape(d.shape).to(d.dtype), d)
    return Fn.q8_0_value(stages[stage][1].reshape(q.shape), d, x)


def scale_steps(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 32-value block's max|x|/127 (fp32, as q8_0_codes computes it before rounding it to fp16) in units of the
    fp16 step at its magnitude, float64 [n, K/32], and that step: fp16's rounding to nearest even is then the
    rounding of this position to the nearest even integer, and its near-ties are those of a code."""
    amax = x.float().reshape(x.shape[0], -1, Fn.Q8_0_BLOCK).abs().amax(dim=-1)
    ratio = (amax / 127.0).double()
    exponent = torch.floor(torch.log2(ratio.clamp_min(2.0 ** -14)))
    step = torch.pow(2.0, exponent - 10)  # fp16: 10 fraction bits; below 2^-14 subnormal, steps of 2^-24
    return ratio / step, step


def clean_rows(base: Ledger, gold: Ledger) -> list[Key]:
    """The rows both runs rounded before they first diverged: a row is left out when, at an earlier MoE layer or
    stage, a row of the same or an earlier token took different codes in the two runs or was rounded by one of
    them only (a router choice). What a causal forward computes for a token depends only on tokens up to it, and a
    stage only on the stages before it, so the rows kept are computed from identical inputs in both runs up to the
    arithmetic's own rounding."""
    first: dict[tuple[int, int], int] = {}  # (layer, stage order) -> the earliest token diverging there
    for key in set(base.rows) | set(gold.rows):
        b, g = base.codes.get(key), gold.codes.get(key)
        if b is None or g is None or b.shape != g.shape or not torch.equal(b, g):
            where = (key[0], STAGE_ORDER[key[2]])
            first[where] = min(first.get(where, key[1]), key[1])
    kept = []
    for key, g in gold.rows.items():
        b = base.rows.get(key)
        if b is None or b.shape != g.shape:
            continue
        where = (key[0], STAGE_ORDER[key[2]])
        if not any(w < where and token <= key[1] for w, token in first.items()):
            kept.append(key)
    return kept


def _windows(base: Ledger, gold: Ledger, factor: float, rows: list[Key]) -> dict[tuple[int, str], float]:
    """Per MoE layer and stage: min(factor x the base-vs-gold RMS over `rows` there, WINDOW_CAP)."""
    by_site: dict[tuple[int, str], list[torch.Tensor]] = {}
    for key in rows:
        by_site.setdefault((key[0], key[2]), []).append(base.rows[key] - gold.rows[key])
    return {site: min(factor * float(torch.cat(diffs).pow(2).mean().sqrt()), WINDOW_CAP)
            for site, diffs in by_site.items()}


def expected_flips(base: Ledger, gold: Ledger, factor: float) -> float:
    """How many of the gold's roundings an implementation `factor` x as far from the gold as the base is expected
    to take the other way: a value whose distance from its boundary is spread evenly over a step crosses it with
    probability 2e when moved by e, here e = min(factor x |base - gold|, WINDOW_CAP) on each value of the clean
    rows, scaled up to every row the gold rounded (the measured density of near-ties over the whole sequence)."""
    rows = clean_rows(base, gold)
    if not rows:
        return 0.0
    moved = torch.cat([base.rows[k] - gold.rows[k] for k in rows]).abs().mul(factor).clamp(max=WINDOW_CAP)
    total = sum(g.numel() for g in gold.rows.values())
    return 2.0 * float(moved.sum()) * total / moved.numel()


def windows(base: Ledger, gold: Ledger, factor: float) -> dict[tuple[int, str], float]:
    """Each site's (MoE layer, stage) near-tie window: `factor` x the base-vs-gold RMS over the values it rounds
    in the rows before the two runs first diverge (clean_rows), never more than WINDOW_CAP."""
    return _windows(base, gold, factor, clean_rows(base, gold))


def near_ties(base: Ledger, gold: Ledger, factor: float,
              within: Mapping[tuple[int, str], float] | None = None) -> list[NearTie]:
    """The roundings of the gold run within their site's window of a boundary, not already forced, nearest the
    boundary first. A site is one MoE layer's stage; its window (`windows`, or `within` when given) is `factor` x
    the base-vs-gold RMS over the values it rounds in the rows before the two runs first diverge, never more than
    WINDOW_CAP: a steadier measure of how far the arithmetic before it moves these values than one row's, and
    one that a divergence (a code or a router choice the runs took differently, which moves everything after it
    by whole steps) cannot inflate. A site with no clean row has no window. With `within`, every row the gold
    rounded is listed (the base is not consulted); otherwise rows the two runs did not both compute are left out."""
    sites = dict(within) if within is not None else windows(base, gold, factor)
    rows = (list(gold.rows) if within is not None else
            [key for key, g in gold.rows.items() if key in base.rows and base.rows[key].shape == g.shape])
    ties: list[NearTie] = []
    for key in rows:
        g, window = gold.rows[key], sites.get((key[0], key[2]), 0.0)
        distance = (g - g.floor() - 0.5).abs()
        for element in (distance <= window).nonzero().flatten().tolist():
            site = Site(key[0], key[1], key[2], key[3], int(element))
            if site in gold.forced:
                continue
            value = float(g[element])
            code = int(torch.tensor(value).round())  # half to even, as the rounding itself
            other = math.floor(value) if code > value else math.ceil(value)
            ties.append(NearTie(site, value, code, other, float(distance[element]), window, factor))
    return sorted(ties, key=lambda t: (t.distance, t.site))
