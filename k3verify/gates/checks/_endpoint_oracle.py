"""The oracle side of the endpoint checks: teacher-forced oracle runs over what the endpoint answered, at the
endpoint's declared precision and one step above it, and the near-tie rule that excuses token disagreements.

The endpoint's own tokens are fed back to the oracle, so every position is judged given the same history the
endpoint had (a disagreement never cascades). `gold` is the oracle one precision above the declared one (fp32
for bf16/fp16, fp64 for fp32); `base` is the oracle at the declared precision. Their distance is the noise a
correct implementation at that precision shows: the logprob bars and the near-tie margins are taken from it.
A quantised precision (oracle/precision.py, e.g. w4a8-q8act) computes both in its emulated arithmetic: an
endpoint that computes so sits near the emulated gold, and the bar is how far that arithmetic moves when only the
rounding underneath it changes. Conventions the user accepted (--accept-convention) apply to both runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3verify.gates import fixtures as fx
from k3verify.gates.gate import CheckContext, SkipCheck
from k3verify.oracle.conventions import applied

TIE_NOISE_FACTOR = 4.0  # a flip within 4x the oracle's own dtype noise at that position is a near-tie
TIE_FRACTION = 1e-3  # ... or within this share of the logit range (serving.greedy.vs_oracle's rule)
NOISE_TOP = 8  # the noise at a position is measured over the gold's top tokens there


@dataclass
class Scores:
    """Oracle log-softmax rows predicting seq[first:], [P, V] float64: gold and base (declared dtype)."""

    gold: torch.Tensor
    base: torch.Tensor

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


def _log_softmax_rows(ctx: CheckContext, seq: list[int], first: int, dtype: torch.dtype) -> torch.Tensor:
    ep = ctx.endpoint
    assert ep is not None  # declared_dtype() refused a run without an endpoint first
    key = f"endpoint.oracle.{dtype}.{ep.precision.name}.{first}.{hash(tuple(seq))}"
    if key not in ctx.cache:
        model = fx.reference_model(ctx, dtype)
        with torch.no_grad(), applied(ep.accepted), ep.precision.emulated():
            logits = model(torch.tensor(seq, device=ctx.device)).logits[first - 1: len(seq) - 1]
        ctx.cache[key] = torch.log_softmax(logits.double().cpu(), dim=-1)
    rows: torch.Tensor = ctx.cache[key]
    return rows


def score(ctx: CheckContext, seq: list[int], first: int) -> Scores:
    """Oracle rows predicting seq[first:] (first >= 1), at the declared dtype and one precision above it."""
    if not 1 <= first <= len(seq):
        raise ValueError(f"first must be in 1..{len(seq)}; got {first}")
    dtype = declared_dtype(ctx)
    gold = ctx.endpoint.precision.gold_dtype if ctx.endpoint is not None else dtype
    return Scores(_log_softmax_rows(ctx, seq, first, gold), _log_softmax_rows(ctx, seq, first, dtype))


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
