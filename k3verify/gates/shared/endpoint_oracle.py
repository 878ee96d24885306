"""The oracle side of the endpoint checks: teacher-forced oracle runs over what the endpoint answered, at the
endpoint's declared precision and one step above it, and the near-tie rule that excuses token disagreements.

The endpoint's own tokens are fed back to the oracle, so every position is judged given the same history the
endpoint had (a disagreement never cascades). `gold` is the oracle one precision above the declared one (fp32
for bf16/fp16, fp64 for fp32); `base` is the oracle at the declared precision. Their distance is the noise a
correct implementation at that precision shows: the logprob bars and the near-tie margins are taken from it.
A quantised precision (oracle/precision.py, e.g. w4a8-q8act) computes both in its emulated arithmetic: an
endpoint that computes so sits near the emulated gold, and the bar is how far that arithmetic moves when only the
rounding underneath it changes. Conventions the user accepted (--accept-convention) apply to both runs.
Such arithmetic has rounding near-ties too (oracle/rounding.py). Its bar is taken from `locked`: the declared
dtype computing with the gold's codes, so the bar is the arithmetic's own noise and never a code the two oracle
runs happened to take differently (one such code moves every later logprob by orders of magnitude more). A logprob
check whose rows of one sequence sit beyond the bar looks for a few roundings which, taken the other way, explain
the distance (`resolve_roundings`), and names each one it excuses. The excuse never moves the bar, and how many
roundings it may excuse is capped by how many a correct implementation is expected to need (`plausible`), per
sequence and per run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from k3verify.gates.core.check import CheckContext, SkipCheck
from k3verify.gates.shared import builders
from k3verify.oracle import gguf_arith, rounding
from k3verify.oracle.conventions import applied
from k3verify.oracle.precision import Precision
from k3verify.oracle.rounding import Ledger, NearTie, Site, expected_flips, near_ties, windows

TIE_NOISE_FACTOR = 4.0  # a flip within 4x the oracle's own dtype noise at that position is a near-tie
TIE_FRACTION = 1e-3  # ... or within this share of the logit range (serving.greedy.vs_oracle's rule)
NOISE_TOP = 8  # the noise at a position is measured over the gold's top tokens there
MAX_FORCED = 4  # rounding near-ties one sequence may take the other way (resolve_roundings), at most
MAX_TRIED = 16  # the near-ties nearest their boundary tried at each step
RUN_CAP = 8  # rounding near-ties one run may excuse over all its sequences and checks, at most
IMPLAUSIBLE = 1e-3  # more excused roundings than a correct implementation needs with this probability are refused
EXCUSED = "endpoint.rounding.excused"  # ctx.cache: sequence -> the roundings resolve_roundings excused on it


@dataclass
class Scores:
    """Oracle log-softmax rows predicting seq[first:], [P, V] float64: gold and base (declared dtype)."""

    gold: torch.Tensor
    base: torch.Tensor
    ledgers: tuple[Ledger, Ledger] | None = None  # (locked, gold) emulated roundings (oracle/rounding.py)
    forced: dict[Site, int] = field(default_factory=dict)  # roundings both runs took the other way
    locked: torch.Tensor | None = None  # the declared dtype with the gold's codes (emulated rounding only)

    def near_ties(self, factor: float) -> list[NearTie]:
        """Roundings within `factor` x the oracle's own noise of a boundary (none without emulated rounding)."""
        return near_ties(*self.ledgers, factor) if self.ledgers is not None else []

    def windows(self, factor: float) -> dict[tuple[int, str], float]:
        """Each rounding site's near-tie window (oracle/rounding.py `windows`; none without emulated rounding)."""
        return windows(*self.ledgers, factor) if self.ledgers is not None else {}

    def expected_flips(self, factor: float) -> float:
        """Roundings an implementation `factor` x as noisy as the oracle is expected to take the other way."""
        return expected_flips(*self.ledgers, factor) if self.ledgers is not None else 0.0

    def for_bar(self) -> Scores:
        """These rows with the base the bars are measured from: the locked run where there is one."""
        return Scores(self.gold, self.locked if self.locked is not None else self.base, self.ledgers, self.forced)

    @property
    def rounded(self) -> bool:
        """Whether the runs rounded anything in an emulated precision."""
        return self.ledgers is not None and bool(self.ledgers[1].rows)

    def noise(self, p: int) -> float:
        """max |base - gold| over the gold's top tokens at position p."""
        top = self.gold[p].topk(min(NOISE_TOP, self.gold.shape[-1])).indices
        return float((self.base[p, top] - self.gold[p, top]).abs().max())

    def tie_threshold(self, p: int) -> float:
        row = self.gold[p]
        return max(TIE_NOISE_FACTOR * self.noise(p), TIE_FRACTION * float(row.max() - row.min()))

    def margin(self, p: int, token: int) -> float:
        """How far `token` is below the gold's greedy choice at p (0 when it is the choice)."""
        return float(self.gold[p].max() - self.gold[p, token])


def declared_dtype(ctx: CheckContext) -> torch.dtype:
    if ctx.endpoint is None:
        raise SkipCheck("no endpoint under test: run `k3verify parity --endpoint URL` (or --endpoint self)")
    return ctx.endpoint.dtype


def _oracle_run(ctx: CheckContext, seq: list[int], first: int, dtype: torch.dtype,
                forced: Mapping[Site, int], follow: Ledger | None = None) -> tuple[torch.Tensor, Ledger]:
    """Log-softmax rows predicting seq[first:] at `dtype` under the declared precision and the accepted
    conventions, with `forced` roundings (and `follow`'s codes elsewhere), and the ledger of its emulated
    roundings; cached per context."""
    ep = ctx.endpoint
    assert ep is not None  # declared_dtype() refused a run without an endpoint first
    key = (f"endpoint.oracle.{dtype}.{ep.precision.name}.{first}.{hash(tuple(seq))}."
           f"{hash(frozenset(forced.items()))}.{'locked' if follow is not None else ''}")
    if key not in ctx.cache:
        model = builders.reference_model(ctx, dtype)
        ledger = Ledger(dict(forced), follow=follow)
        with torch.no_grad(), applied(ep.accepted), ep.precision.emulated(), rounding.recording(ledger):
            logits = model(torch.tensor(seq, device=ctx.device)).logits[first - 1: len(seq) - 1]
        ctx.cache[key] = (torch.log_softmax(logits.double().cpu(), dim=-1), ledger)
    rows: tuple[torch.Tensor, Ledger] = ctx.cache[key]
    return rows


def excused_roundings(ctx: CheckContext, seq: list[int]) -> dict[Site, int]:
    """The rounding near-ties a logprob check excused on `seq` in this run (none when it excused none)."""
    excused: dict[tuple[int, ...], dict[Site, int]] = ctx.cache.get(EXCUSED, {})
    return dict(excused.get(tuple(seq), {}))


def declared_precision(ctx: CheckContext) -> Precision:
    declared_dtype(ctx)
    assert ctx.endpoint is not None  # declared_dtype() refused a run without an endpoint
    return ctx.endpoint.precision


def score(ctx: CheckContext, seq: list[int], first: int, forced: Mapping[Site, int] | None = None) -> Scores:
    """Oracle rows predicting seq[first:] (first >= 1), at the declared dtype and one precision above it, both with
    the `forced` roundings (none by default), and the near-tie roundings of the two runs."""
    if not 1 <= first <= len(seq):
        raise ValueError(f"first must be in 1..{len(seq)}; got {first}")
    forced = dict(forced or {})
    gold, gold_ledger = _oracle_run(ctx, seq, first, declared_precision(ctx).gold_dtype, forced)
    base, base_ledger = _oracle_run(ctx, seq, first, declared_dtype(ctx), forced)
    if not gold_ledger.rows:
        return Scores(gold, base, None, forced)
    locked, locked_ledger = _oracle_run(ctx, seq, first, declared_dtype(ctx), forced, follow=gold_ledger)
    return Scores(gold, base, (locked_ledger, gold_ledger), forced, locked)


def plausible(expected: float) -> int:
    """The most roundings a correct implementation expected to take `expected` of them the other way (a Poisson
    count) takes with probability above IMPLAUSIBLE; more is a fault, however well they explain a distance."""
    k, term = 0, math.exp(-expected)
    tail = 1.0 - term
    while tail > IMPLAUSIBLE:
        k += 1
        term *= expected / k
        tail -= term
    return k


def _run_excused(ctx: CheckContext, seq: list[int]) -> int:
    """Roundings this run excused so far on sequences other than `seq`."""
    excused: dict[tuple[int, ...], dict[Site, int]] = ctx.cache.get(EXCUSED, {})
    return sum(len(sites) for key, sites in excused.items() if key != tuple(seq))


def code_pinned(ctx: CheckContext, seq: list[int], first: int) -> tuple[Scores, int] | None:
    """For a precision that rounds activations to GGUF block codes (oracle/gguf_arith.py), the gold's rows
    with its codes pinned to the declared-dtype run's wherever they differ only at a near-tie, beside the
    declared-dtype run's rows, and how many codes were pinned; None for any other precision. A diagnosis of the
    oracle's own distance, never a bar: an endpoint's own near-tie codes cannot be pinned."""
    precision = declared_precision(ctx)
    if gguf_arith.KNOB not in dict(precision.emulation):
        return None
    ep = ctx.endpoint
    assert ep is not None  # declared_precision() refused a run without an endpoint
    key = f"endpoint.oracle.code_pinned.{ep.precision.name}.{first}.{hash(tuple(seq))}"
    if key not in ctx.cache:
        ids = torch.tensor(seq, device=ctx.device)
        recorded = gguf_arith.CodePins()
        rows = []
        for dtype, pins in ((precision.dtype, recorded), (precision.gold_dtype, gguf_arith.CodePins(
                follow=recorded.scaled))):
            model = builders.reference_model(ctx, dtype)
            with torch.no_grad(), applied(ep.accepted), precision.emulated(), gguf_arith.pinning_codes(pins):
                logits = model(ids).logits[first - 1: len(seq) - 1]
            rows.append(torch.log_softmax(logits.double().cpu(), dim=-1))
        ctx.cache[key] = (Scores(rows[1], rows[0]), pins.pinned)
    result: tuple[Scores, int] = ctx.cache[key]
    return result


def resolve_roundings(ctx: CheckContext, seq: list[int], first: int, scores: Scores,
                      distance: Callable[[Scores], float], bar: float, factor: float, *,
                      partial: bool = False) -> tuple[Scores, list[str]]:
    """Rows of an endpoint sitting `distance(scores)` > `bar` from the gold may differ by rounding near-ties of
    the declared precision (oracle/rounding.py): equally correct codes that the endpoint's arithmetic took the
    other way, within `factor` (the check's bar factor) x the oracle's own noise of a rounding boundary (at most
    WINDOW_CAP of a step). Greedily, take the near-tie whose other code (forced in the gold) lowers the distance
    most, MAX_TRIED candidates a step, nearest their boundary first, as many as a correct implementation
    plausibly needs (`plausible` of the expected count, at most MAX_FORCED and what is left of RUN_CAP). The bar
    is the caller's, measured before anything was forced, and stays so. When the distance ends within `bar`: the
    scores with those codes forced in both runs and a line per excused rounding; otherwise the scores unchanged
    and one line saying what was tried. With `partial` (a caller judging several sequences together, whose
    `distance` is of all of them), the codes that lowered the distance are returned and recorded even where it
    stays above `bar`: the caller withdraws them unless the whole ends within its bar. A fault is not a handful of
    one-code steps at near-ties, so it stays above the bar."""
    start = best = distance(scores)
    current, taken = scores, list[str]()
    gold_dtype = declared_precision(ctx).gold_dtype
    within = scores.windows(factor)  # the windows of the runs before anything was forced, kept throughout
    ties = scores.near_ties(factor)
    found, expected = len(ties), scores.expected_flips(factor)
    limit = max(0, min(MAX_FORCED, plausible(expected), RUN_CAP - _run_excused(ctx, seq)))
    while best > bar and len(taken) < limit and ties:
        trials = []
        for tie in ties[:MAX_TRIED]:
            forced = {**current.forced, tie.site: tie.other}
            gold, ledger = _oracle_run(ctx, seq, first, gold_dtype, forced)
            trials.append((distance(Scores(gold, current.base)), [tie], forced))
            # a code taken the other way moves what comes after it: the rounding it brings nearest a boundary
            # may be one the endpoint took the other way too, and only the pair explains the distance
            known = {t.site for t in ties}
            then = [t for t in near_ties(ledger, ledger, factor, within) if t.site not in known]
            if then and len(taken) + 2 <= limit:
                pair = {**forced, then[0].site: then[0].other}
                gold = _oracle_run(ctx, seq, first, gold_dtype, pair)[0]
                trials.append((distance(Scores(gold, current.base)), [tie, then[0]], pair))
        d, chosen, forced = min(trials, key=lambda trial: trial[0])
        if d >= best:
            break
        current, best = score(ctx, seq, first, forced), d
        ties = near_ties(*current.ledgers, factor, within) if current.ledgers is not None else []
        ties = [t for t in ties if t.site not in current.forced]
        taken += [f"rounding near-tie excused at {tie.describe()}; distance then {d:.3g}" for tie in chosen]
    allowance = (f"a correct implementation is expected to take {expected:.2g} of this sequence's roundings the "
                 f"other way: at most {limit} excused here (of {MAX_FORCED} a sequence, {RUN_CAP} a run)")
    if best > bar and not (partial and taken):
        return scores, ([f"{found} rounding near-tie(s) of the declared precision (the {min(found, MAX_TRIED)} "
                         f"nearest their boundary tried); {allowance}: none brings the distance {start:.3g} within "
                         f"the bar {bar:.3g} (best {best:.3g}); none excused"] if found else [])
    ctx.cache.setdefault(EXCUSED, {})[tuple(seq)] = dict(current.forced)
    beyond = ", still beyond it" if best > bar else ""  # partial: the caller withdraws them unless its whole fits
    return current, [f"distance {start:.3g} > bar {bar:.3g}; {len(taken)} rounding near-tie(s) of the declared "
                     f"precision taken the other way bring it to {best:.3g}{beyond} ({allowance})", *taken]


@dataclass
class TokenVerdicts:
    """Token-by-token judgement of an endpoint's tokens against the gold's greedy choices."""

    reference: list[int]  # the gold's choice, or the endpoint's token where the disagreement is a near-tie
    excused: list[str]
    failures: list[str]
    min_excused_margin: float = float("inf")


def judge_tokens(scores: Scores, tokens: list[int], label: str) -> TokenVerdicts:
    """The gold's greedy token at each position; a different endpoint token within the near-tie threshold is
    excused (and counted, with the margin), any other difference is a failure naming the position."""
    out = TokenVerdicts([], [], [])
    for p, token in enumerate(tokens):
        choice = int(scores.gold[p].argmax())
        margin, threshold = scores.margin(p, token), scores.tie_threshold(p)
        if token == choice:
            out.reference.append(choice)
        elif margin <= threshold:
            out.reference.append(token)
            out.min_excused_margin = min(out.min_excused_margin, margin)
            out.excused.append(f"{label} position {p}: endpoint token {token}, oracle {choice}, margin {margin:.3g} "
                               f"<= near-tie {threshold:.3g} (excused)")
        else:
            out.reference.append(choice)
            out.failures.append(f"{label} position {p}: endpoint token {token} where the oracle's greedy token is "
                                f"{choice} (margin {margin:.3g} > near-tie {threshold:.3g})")
    return out


def shifted_control(tokens: list[int], reference: list[int], vocab_size: int) -> list[int]:
    """The tokens with one id shifted by one, at the middle position where they agree with the reference."""
    agree = [p for p, (t, r) in enumerate(zip(tokens, reference, strict=True)) if t == r]
    if not agree:
        return [*tokens, 0]  # nothing agrees: a longer answer is wrong too
    p = agree[len(agree) // 2]
    return [*tokens[:p], (tokens[p] + 1) % vocab_size, *tokens[p + 1:]]


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300))
