"""The engine's speculative decode step (`serve --speculative ngram --num-draft K`).

Engine._step hands its decode batch to SpeculativeStep.run before decoding: every sequence that has
drafts (the drafter proposed something), room in its budget for k+1 positions and speculation still on
(policy.py) is verified in one packed pass, with the batch's other greedy sequences riding along on filler
drafts (offline.filler_drafts); acceptance is greedy for greedy requests and rejection
sampling with the request's counter-based draws otherwise; the accepted prefixes are committed; the emitted
tokens go out through the engine one by one (a stop token or max_tokens ends the request there, and the
rest is dropped). The sequences it did not verify are returned for the plain decode step.
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
from k3verify.serving.spec.policy import CostGate, SpecPolicy, SpecStats
from k3verify.serving.spec.verifier import SpecVerifier

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
    verify_steps: int = 0
    verified_rows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    turned_off: int = 0  # requests whose speculation the policy switched off
    rider_rows: int = 0  # greedy rows without drafts that rode along in a verify pass instead of a decode step
    gated_steps: int = 0  # steps with drafts that the cost gate sent to plain decode
    plain_ahead_steps: int = 0  # steps the engine decoded with launch-ahead while the gate declined their batch size


class SpeculativeStep:
    def __init__(self, verifier: SpecVerifier, drafter: Drafter, policy: SpecPolicy | None = None,
                 gate: CostGate | None = None) -> None:
        if drafter.num_draft != verifier.num_draft:
            raise ValueError(f"drafter proposes {drafter.num_draft} tokens, the verifier checks {verifier.num_draft}")
        self.verifier, self.drafter = verifier, drafter
        self.policy = policy if policy is not None else SpecPolicy()
        self.gate = gate  # policy.CostGate: verify only when it pays at this batch size (None: whenever drafted)
        self.stats: dict[int, SpecStats] = {}
        self.counters = SpecCounters()

    def run(self, host: SpecHost, batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Verify what can be verified this step; return the sequences left for plain decode."""
        live = {s.seq_id for s in batch}
        self.stats = {sid: st for sid, st in self.stats.items() if sid in live}
        rows: list[tuple[Request, list[int]]] = []
        rest: list[ScheduledSeq] = []
        for seq in batch:
            drafts = self._drafts(host.spec_request(seq.seq_id))
            if drafts and len(rows) < self.verifier.max_rows:
                rows.append((host.spec_request(seq.seq_id), drafts))
            else:
                rest.append(seq)
        drafted = len(rows)
        if rows:  # greedy rows without drafts ride along: one step for the batch (offline.filler_drafts)
            riders = [seq for seq in rest if self._can_ride(host.spec_request(seq.seq_id))][
                : self.verifier.max_rows - len(rows)]
            if self.gate is not None and not self.gate.verify_now(
                    len(batch), [self.stats[req.seq_id] for req, _ in rows], len(riders), self.verifier.num_draft):
                self.counters.gated_steps += 1
                return batch
            rows += [(req, filler_drafts(req.last_token, self.verifier.num_draft))
                     for req in (host.spec_request(seq.seq_id) for seq in riders)]
            rest = [seq for seq in rest if seq not in riders]
            start = time.perf_counter()
            self._verify(host, rows, drafted)
            if self.gate is not None and not rest:
                self.gate.record_verify(len(batch), time.perf_counter() - start)
        return rest

    def plain_ahead(self, batch: int) -> bool:
        """Whether the engine's next step of `batch` decoding sequences may skip drafting and run as a plain
        launch-ahead step: the cost gate is declining at that size (CostGate.take_plain_step, which counts it)."""
        if self.gate is None or not self.gate.take_plain_step(batch):
            return False
        self.counters.plain_ahead_steps += 1
        return True

    def record_plain_step(self, batch: int, seconds: float) -> None:
        """The engine timed a plain decode step of its whole decode batch (no prompt chunk in it) as the
        launch-ahead loop would pay for it (timing.StepTimer): the gate's other half."""
        if self.gate is not None:
            self.gate.record_decode(batch, seconds)

    def _can_ride(self, req: Request) -> bool:
        """Greedy only: a sampled rider would spend its counter-based draws in a verify pass rather than a decode
        step, and a seeded request's text would then depend on what else shares its batch."""
        return req.params.is_greedy and self.verifier.can_verify(req.seq_id)

    def _useful(self, req: Request) -> int:
        return useful_drafts(self.verifier.num_draft, req.params.max_tokens - len(req.output_ids))

    def _drafts(self, req: Request) -> list[int]:
        stats = self.stats.setdefault(req.seq_id, SpecStats())
        if stats.off or not self._useful(req) or not self.verifier.can_verify(req.seq_id):
            return []
        proposed = self.drafter.propose(req.seq_id, req.prompt_ids + req.output_ids)
        return pad_drafts(proposed, self.verifier.num_draft) if proposed else []

    def _accept_greedy_on_device(self, logits: torch.Tensor, rows: list[tuple[Request, list[int]]]
                                 ) -> tuple[list[Accepted], set[int]]:
        """Every row greedy: acceptance and the commit on the device right behind the verify (rows with non-finite
        logits accept nothing), then one transfer of ids, counts and non-finite flags."""
        B, n = logits.shape[0], self.verifier.num_positions
        flags = nonfinite_mask(logits.flatten(0, 1)).view(B, n).any(dim=1)
        host = self.verifier.commit_greedy(logits, [d for _, d in rows], reject=flags).tolist()  # ids, count, flag
        bad = {r for r, row in enumerate(host) if row[-1]}
        results = accept_read_back([row[:-1] for row in host], [d for _, d in rows], bad)
        self.verifier.committed([a.num_accepted for a in results])
        return results, bad

    def _verify(self, host: SpecHost, rows: list[tuple[Request, list[int]]], drafted: int) -> None:
        """rows[:drafted] carry drafts, the rest are riders (filler drafts): not counted by the policy or the
        acceptance counters."""
        n = self.verifier.num_positions
        useful = [self._useful(req) for req, _ in rows[:drafted]]  # before this pass's tokens are emitted
        logits = self.verifier.verify([(req.seq_id, [req.last_token, *drafts]) for req, drafts in rows])
        if all(req.params.is_greedy for req, _ in rows):
            results, bad = self._accept_greedy_on_device(logits, rows)
        else:
            bad = {i // n for i in nonfinite_rows(logits.flatten(0, 1))}
            best = logits.argmax(dim=-1).tolist()  # greedy rows: one transfer for the whole batch
            results = [Accepted(0, []) if r in bad else accept_greedy_ids(best[r], drafts) if req.params.is_greedy
                       else accept_sampled(logits[r], drafts, req.params, req.seed, req.next_position)
                       for r, (req, drafts) in enumerate(rows)]
            self.verifier.commit([a.num_accepted for a in results])
        c, now = self.counters, time.monotonic()
        c.verify_steps += 1
        for r, ((req, _), acc) in enumerate(zip(rows, results, strict=True)):
            if r in bad:
                host.spec_fail(req, f"model produced non-finite logits (NaN/inf) in a verify pass at step "
                                    f"{len(req.output_ids)}")
                continue
            if r < drafted:
                stats = self.stats[req.seq_id]
                was_on = not stats.off
                counted = self.policy.record(stats, useful[r], acc.num_accepted)
                c.turned_off += int(was_on and stats.off)
                c.verified_rows, c.drafted = c.verified_rows + 1, c.drafted + useful[r]
                c.accepted += counted
            else:
                c.rider_rows += 1
            lps = token_logprobs(logits[r, : len(acc.tokens)], acc.tokens, [req.params.logprobs] * len(acc.tokens))
            for tok, lp in zip(acc.tokens, lps, strict=True):
                c.emitted += 1
                if host.spec_emit(req, tok, lp, now):
                    break  # a stop token or max_tokens finished the request: the rest is dropped


def build_speculative_step(runner: ModelRunner, drafter: str, num_draft: int, max_rows: int, *, fused: bool = False,
                           policy: SpecPolicy | None = None, gate: CostGate | None = None) -> SpeculativeStep:
    """The engine's speculator for `serve --speculative DRAFTER --num-draft K` (one verify row per running slot)."""
    if drafter not in SPEC_DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; known: {', '.join(SPEC_DRAFTERS)}")
    if num_draft < 1:
        raise ValueError(f"--num-draft must be >= 1; got {num_draft}")
    return SpeculativeStep(SpecVerifier(runner, num_draft, max_rows, fused=fused), NgramDrafter(num_draft), policy,
                           gate)
