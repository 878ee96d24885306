"""The engine's speculative decode step (`serve --speculative ngram --num-draft K`).

EngineLoop._step hands its decode batch to SpeculativeStep.run before decoding: every sequence that has
drafts (the drafter proposed something), room in its budget for k+1 positions and speculation still on
(policy.py) is scored in one packed pass, with the batch's other greedy sequences riding along on filler
drafts (offline.filler_drafts); acceptance is greedy for greedy requests and rejection
sampling with the request's counter-based draws otherwise; the accepted prefixes are committed; the emitted
tokens go out through the engine one by one (a stop token or max_tokens ends the request there, and the
rest is dropped). The sequences it did not score are returned for the plain decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from k3verify.serving.request import Request
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import TokenLogprob, nonfinite_mask, nonfinite_rows, token_logprobs
from k3verify.serving.scheduler import ScheduledSeq
from k3verify.serving.spec.accept import Accepted, accept_greedy_ids, accept_read_back, accept_sampled
from k3verify.serving.spec.drafter import Drafter, NgramDrafter
from k3verify.serving.spec.offline import filler_drafts, pad_drafts, useful_drafts
from k3verify.serving.spec.policy import CostPolicy, SpecPolicy, SpecStats
from k3verify.serving.spec.scorer import SpecScorer

SPEC_DRAFTERS = ("ngram",)


class SpecHost(Protocol):
    """What the step needs of the engine (serving/engine.py implements it)."""

    def spec_request(self, seq_id: int) -> Request: ...
    def spec_emit(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> bool:
        """Emit one token; True when the request is finished (or dropped) afterwards."""
        ...
    def spec_fail(self, req: Request, message: str) -> None: ...


@dataclass
class SpecCounters:
    score_steps: int = 0
    scored_rows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    turned_off: int = 0  # requests whose speculation the policy switched off
    rider_rows: int = 0  # greedy rows without drafts that rode along in a score pass instead of a decode step
    declined_steps: int = 0  # steps with drafts that the cost policy sent to plain decode
    plain_ahead_steps: int = 0  # steps decoded with launch-ahead while the cost policy declined their batch size


class SpeculativeStep:
    def __init__(self, scorer: SpecScorer, drafter: Drafter, policy: SpecPolicy | None = None,
                 cost_policy: CostPolicy | None = None) -> None:
        if drafter.num_draft != scorer.num_draft:
            raise ValueError(f"drafter proposes {drafter.num_draft} tokens, the scorer checks {scorer.num_draft}")
        self.scorer, self.drafter = scorer, drafter
        self.policy = policy if policy is not None else SpecPolicy()
        self.cost_policy = cost_policy  # policy.CostPolicy: score only where it pays at this batch size (None: always)
        self.stats: dict[int, SpecStats] = {}
        self.counters = SpecCounters()

    def run(self, host: SpecHost, batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Score what can be scored this step; return the sequences left for plain decode."""
        live = {s.seq_id for s in batch}
        self.stats = {sid: st for sid, st in self.stats.items() if sid in live}
        rows: list[tuple[Request, list[int]]] = []
        rest: list[ScheduledSeq] = []
        for seq in batch:
            drafts = self._drafts(host.spec_request(seq.seq_id))
            if drafts and len(rows) < self.scorer.max_rows:
                rows.append((host.spec_request(seq.seq_id), drafts))
            else:
                rest.append(seq)
        drafted = len(rows)
        if rows:  # greedy rows without drafts ride along: one step for the batch (offline.filler_drafts)
            riders = [seq for seq in rest if self._can_ride(host.spec_request(seq.seq_id))][
                : self.scorer.max_rows - len(rows)]
            if self.cost_policy is not None and not self.cost_policy.score_now(
                    len(batch), [self.stats[req.seq_id] for req, _ in rows], len(riders), self.scorer.num_draft):
                self.counters.declined_steps += 1
                return batch
            rows += [(req, filler_drafts(req.last_token, self.scorer.num_draft))
                     for req in (host.spec_request(seq.seq_id) for seq in riders)]
            rest = [seq for seq in rest if seq not in riders]
            start = time.perf_counter()
            self._score(host, rows, drafted)
            if self.cost_policy is not None and not rest:
                self.cost_policy.record_score(len(batch), time.perf_counter() - start)
        return rest

    def plain_ahead(self, batch: int) -> bool:
        """Whether the engine's next step of `batch` decoding sequences may skip drafting and run as a plain
        launch-ahead step: the cost policy is declining at that size (CostPolicy.take_plain_step, which counts it)."""
        if self.cost_policy is None or not self.cost_policy.take_plain_step(batch):
            return False
        self.counters.plain_ahead_steps += 1
        return True

    def record_plain_step(self, batch: int, seconds: float) -> None:
        """The engine timed a plain decode step of its whole decode batch (no prompt chunk in it) as the
        launch-ahead loop would pay for it (step_timer.StepTimer): the cost policy's other half."""
        if self.cost_policy is not None:
            self.cost_policy.record_decode(batch, seconds)

    def _can_ride(self, req: Request) -> bool:
        """Greedy only: a sampled rider would spend its counter-based draws in a score pass rather than a decode
        step, and a seeded request's text would then depend on what else shares its batch."""
        return req.params.is_greedy and self.scorer.can_score(req.seq_id)

    def _useful(self, req: Request) -> int:
        return useful_drafts(self.scorer.num_draft, req.params.max_tokens - len(req.output_ids))

    def _drafts(self, req: Request) -> list[int]:
        stats = self.stats.setdefault(req.seq_id, SpecStats())
        if stats.off or not self._useful(req) or not self.scorer.can_score(req.seq_id):
            return []
        proposed = self.drafter.propose(req.seq_id, req.prompt_ids + req.output_ids)
        return pad_drafts(proposed, self.scorer.num_draft) if proposed else []

    def _accept_greedy_on_device(self, logits: torch.Tensor, rows: list[tuple[Request, list[int]]]
                                 ) -> tuple[list[Accepted], set[int]]:
        """Every row greedy: acceptance and the commit on the device right behind the score (rows with non-finite
        logits accept nothing), then one transfer of ids, counts and non-finite flags."""
        B, n = logits.shape[0], self.scorer.num_positions
        flags = nonfinite_mask(logits.flatten(0, 1)).view(B, n).any(dim=1)
        host = self.scorer.commit_greedy(logits, [d for _, d in rows], reject=flags).tolist()  # ids, count, flag
        bad = {r for r, row in enumerate(host) if row[-1]}
        results = accept_read_back([row[:-1] for row in host], [d for _, d in rows], bad)
        self.scorer.committed([a.num_accepted for a in results])
        return results, bad

    def _score(self, host: SpecHost, rows: list[tuple[Request, list[int]]], drafted: int) -> None:
        """rows[:drafted] carry drafts, the rest are riders (filler drafts): not counted by the policy or the
        acceptance counters."""
        n = self.scorer.num_positions
        useful = [self._useful(req) for req, _ in rows[:drafted]]  # before this pass's tokens are emitted
        logits = self.scorer.score([(req.seq_id, [req.last_token, *drafts]) for req, drafts in rows])
        if all(req.params.is_greedy for req, _ in rows):
            results, bad = self._accept_greedy_on_device(logits, rows)
        else:
            bad = {i // n for i in nonfinite_rows(logits.flatten(0, 1))}
            best = logits.argmax(dim=-1).tolist()  # greedy rows: one transfer for the whole batch
            results = [Accepted(0, []) if r in bad else accept_greedy_ids(best[r], drafts) if req.params.is_greedy
                       else accept_sampled(logits[r], drafts, req.params, req.seed, req.next_position)
                       for r, (req, drafts) in enumerate(rows)]
            self.scorer.commit([a.num_accepted for a in results])
        c, now = self.counters, time.monotonic()
        c.score_steps += 1
        for r, ((req, _), acc) in enumerate(zip(rows, results, strict=True)):
            if r in bad:
                host.spec_fail(req, f"model produced non-finite logits (NaN/inf) in a score pass at step "
                                    f"{len(req.output_ids)}")
                continue
            if r < drafted:
                stats = self.stats[req.seq_id]
                was_on = not stats.off
                counted = self.policy.record(stats, useful[r], acc.num_accepted)
                c.turned_off += int(was_on and stats.off)
                c.scored_rows, c.drafted = c.scored_rows + 1, c.drafted + useful[r]
                c.accepted += counted
            else:
                c.rider_rows += 1
            lps = token_logprobs(logits[r, : len(acc.tokens)], acc.tokens, [req.params.logprobs] * len(acc.tokens))
            for tok, lp in zip(acc.tokens, lps, strict=True):
                c.emitted += 1
                if host.spec_emit(req, tok, lp, now):
                    break  # a stop token or max_tokens finished the request: the rest is dropped


def build_speculative_step(runner: ModelRunner, drafter: str, num_draft: int, max_rows: int, *, fused: bool = False,
                           policy: SpecPolicy | None = None, cost_policy: CostPolicy | None = None) -> SpeculativeStep:
    """The engine's speculator for `serve --speculative DRAFTER --num-draft K` (one score row per running slot)."""
    if drafter not in SPEC_DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; known: {', '.join(SPEC_DRAFTERS)}")
    if num_draft < 1:
        raise ValueError(f"--num-draft must be >= 1; got {num_draft}")
    return SpeculativeStep(SpecScorer(runner, num_draft, max_rows, fused=fused), NgramDrafter(num_draft), policy,
                           cost_policy)
