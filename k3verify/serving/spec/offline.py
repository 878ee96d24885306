"""Offline speculative greedy generation (the checks and the bench; the server goes through step.py).

Each round: every live sequence whose drafter proposes something, whose policy still allows it and whose
budget has room for k+1 more positions (sequences reserve k positions past their need: spec_reservation) is
scored in one packed pass (drafts padded to k by repeating the last one). When such a pass runs, the other
live sequences with room ride along in it with filler drafts (filler_drafts) instead of taking a decode step of
their own: a round that runs both a score step and a decode step pays for two steps where one does the work.
Sequences without room
take one plain decode step. Greedy acceptance, then a commit of each scored row's accepted prefix. Tokens past
max_new_tokens are dropped.

With a cost policy (policy.CostPolicy), a round whose whole batch is one kind of step is timed for it: a score round
by the wall clock around it, a plain step by step_timer.StepTimer (on CUDA the device's time from the graph replay
on, without the input fill and round trip that this in-order step pays and the launch-ahead _plain_tail it stands
for does not).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from k3verify.serving.kv_cache import CacheError
from k3verify.serving.scheduler import spec_reservation
from k3verify.serving.spec.accept import accept_read_back
from k3verify.serving.spec.drafter import Drafter
from k3verify.serving.spec.policy import CostPolicy, SpecPolicy, SpecStats
from k3verify.serving.spec.scorer import SpecScorer
from k3verify.serving.spec.step_timer import StepTimer

if TYPE_CHECKING:
    from k3verify.serving.graphs import GraphDecoder
    from k3verify.serving.spec.score_graphs import ScoreGraphs


@dataclass
class SpecRun:
    tokens: list[list[int]]  # generated tokens per prompt
    stats: list[SpecStats]  # per prompt
    score_steps: int = 0
    decode_steps: int = 0
    accepted_per_row: list[int] = field(default_factory=list)  # every scored row's accepted drafts
    rider_rows: int = 0  # score rows that rode along without drafts (instead of a separate decode step)
    cost_off: bool = False  # the cost policy turned scoring off for the rest of the run (policy.CostPolicy)

    @property
    def acceptance(self) -> float:
        """Accepted drafts / drafted tokens over all score rows (nan when nothing was scored)."""
        drafted = sum(s.drafted for s in self.stats)
        return sum(s.accepted for s in self.stats) / drafted if drafted else float("nan")


def pad_drafts(drafts: list[int], k: int) -> list[int]:
    """Exactly k drafts: cut, or repeat the last proposal (a score row is always k+1 tokens)."""
    return (drafts + [drafts[-1]] * k)[:k]


def useful_drafts(k: int, left: int) -> int:
    """Of k drafts, how many can still become output for a sequence with `left` tokens to go (the score's bonus
    token is one of them). Only these count as drafted for the policy and the measured acceptance: a sequence
    near its end reserves room for a full score (scheduler.spec_reservation), and drafts past its end are
    dropped whatever the model says of them. Under 1 the sequence drafts nothing and rides along."""
    return max(0, min(k, left - 1))


def filler_drafts(last: int, k: int) -> list[int]:
    """The k positions of a greedy row that rides along in a score pass without drafts of its own (speculation
    off, or nothing proposed): its last token repeated. Greedy acceptance keeps exactly the tokens the model's
    argmax agrees with, so a rider emits its plain decode token (the bonus at position 0) and whatever filler
    happens to equal the argmax: never a token the model would not have chosen."""
    return [last] * k


def generate_speculative(scorer: SpecScorer, drafter: Drafter, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int, *, policy: SpecPolicy | None = None,
                         score_graphs: ScoreGraphs | None = None,
                         decode_graphs: GraphDecoder | None = None,
                         after_prefill: Callable[[], None] | None = None,
                         cost_policy: CostPolicy | None = None) -> SpecRun:
    """Greedy generation of max_new_tokens per prompt, all prompts admitted at once. The drafter is asked
    with the prompt's index as its key. `after_prefill` is called once the prefill's work is issued (the bench
    marks the device timeline there, to time the decode phase alone). `cost_policy` (policy.CostPolicy, kept by the
    caller across runs as an engine keeps it): score only when it pays at this batch size; None scores whenever
    there are drafts (the checks: they must exercise scoring whatever the machine's timings)."""
    runner = scorer.runner
    if max_new_tokens < 1 or not prompts or len(prompts) > scorer.max_rows:
        raise ValueError(f"need max_new_tokens >= 1 and 1..{scorer.max_rows} prompts; got {max_new_tokens}, "
                         f"{len(prompts)}")
    policy = policy if policy is not None else SpecPolicy()
    base = max(runner.active_ids, default=-1) + 1
    ids = list(range(base, base + len(prompts)))
    limit = min([runner.max_context] + [g.max_context for g in (score_graphs, decode_graphs) if g is not None])
    for sid, p in zip(ids, prompts, strict=True):
        need = len(p) + max_new_tokens
        if not runner.can_admit(need):
            raise CacheError(f"prompt of {len(p)} tokens + {max_new_tokens} new does not fit the free cache")
        runner.admit(sid, spec_reservation(runner, need, scorer.num_draft, limit))
    run = SpecRun([[] for _ in prompts], [SpecStats() for _ in prompts])
    try:
        first = runner.prefill([(sid, list(p)) for sid, p in zip(ids, prompts, strict=True)]).argmax(-1).tolist()
        if after_prefill is not None:
            after_prefill()
        for out, tok in zip(run.tokens, first, strict=True):
            out.append(tok)
        while live := [i for i in range(len(prompts)) if len(run.tokens[i]) < max_new_tokens]:
            if all(run.stats[i].off for i in live):
                _plain_tail(scorer, ids, live, run, max_new_tokens, decode_graphs)
                break
            if not _round(scorer, drafter, policy, prompts, ids, live, run, max_new_tokens, score_graphs,
                          decode_graphs, cost_policy):
                _plain_tail(scorer, ids, live, run, max_new_tokens, decode_graphs)  # the cost policy said no with what
                run.cost_off = True  # it knows, and without scores it learns nothing new in this run
                break
    finally:
        for sid in ids:
            runner.release(sid)
    for out in run.tokens:
        del out[max_new_tokens:]
    return run


def _round(scorer: SpecScorer, drafter: Drafter, policy: SpecPolicy, prompts: Sequence[Sequence[int]],
           ids: list[int], live: list[int], run: SpecRun, max_new_tokens: int, score_graphs: ScoreGraphs | None,
           decode_graphs: GraphDecoder | None, cost_policy: CostPolicy | None = None) -> bool:
    """One round; False when the cost policy chose plain decoding although it had timed both kinds of step."""
    k = scorer.num_draft
    rows: list[tuple[int, list[int]]] = []  # (prompt index, drafts)
    plain: list[int] = []
    useful = {i: useful_drafts(k, max_new_tokens - len(run.tokens[i])) for i in live}
    for i in live:
        drafts = [] if run.stats[i].off or not useful[i] or not scorer.can_score(ids[i]) else \
            drafter.propose(i, list(prompts[i]) + run.tokens[i])
        if drafts:
            rows.append((i, pad_drafts(drafts, k)))
        else:
            plain.append(i)
    drafted = len(rows)
    riders = [i for i in plain if scorer.can_score(ids[i])] if rows else []
    timed = cost_policy is not None and len(rows) + len(riders) == len(live)  # the whole batch in one kind of step
    if rows and cost_policy is not None and not cost_policy.score_now(len(live), [run.stats[i] for i, _ in rows],
                                                                      len(riders), k):
        if len(live) in cost_policy.decode_s:
            return False
        plain, rows = live, []
    start = time.perf_counter()
    if rows:  # rows without drafts ride along: one step for the batch, not a score and a decode
        rows += [(i, filler_drafts(run.tokens[i][-1], k)) for i in riders]
        plain = [i for i in plain if i not in riders]
        logits = scorer.score([(ids[i], [run.tokens[i][-1], *d]) for i, d in rows], score_graphs)
        # acceptance and commit on the device, right behind the score; then one transfer of [B][k+1 ids, count]
        out = scorer.commit_greedy(logits, [d for _, d in rows]).tolist()
        if cost_policy is not None and timed:
            cost_policy.record_score(len(live), time.perf_counter() - start)
        results = accept_read_back(out, [d for _, d in rows])
        scorer.committed([a.num_accepted for a in results])
        for r, ((i, _), a) in enumerate(zip(rows, results, strict=True)):
            run.tokens[i].extend(a.tokens)
            if r < drafted:  # a rider's fillers are no drafts: neither the policy nor the acceptance counts them
                run.accepted_per_row.append(policy.record(run.stats[i], useful[i], a.num_accepted))
        run.score_steps += 1
        run.rider_rows += len(rows) - drafted
    if plain:  # one step with a host round trip: the drafter and the policy need these tokens next round
        step = [(ids[i], run.tokens[i][-1]) for i in plain]
        # the cost policy's alternative to a score pass is a launch-ahead plain step (_plain_tail): timed without the
        # round trip
        timer = StepTimer(scorer.runner.device) if cost_policy is not None and len(plain) == len(live) else None
        with timer.starting_at_replay(decode_graphs) if timer is not None else contextlib.nullcontext():
            best = scorer.runner.decode(step, decode_graphs).argmax(-1)
        if timer is not None:
            timer.launched()
        for i, tok in zip(plain, best.tolist(), strict=True):
            run.tokens[i].append(tok)
        if cost_policy is not None and timer is not None:
            cost_policy.record_decode(len(live), timer.seconds())
        run.decode_steps += 1
    return True


def _plain_tail(scorer: SpecScorer, ids: list[int], live: list[int], run: SpecRun, max_new_tokens: int,
                decode_graphs: GraphDecoder | None) -> None:
    """Every live row turned speculation off: decode the rest as the plain bench path does, each step fed the
    previous step's ids on the device, one readback at the end (a round trip per step is a sizeable share of a
    batch-1 decode step). Rows sorted by tokens still needed, so the rows left
    after each step are a prefix of the batch and the next step's inputs are a slice, never an index copy."""
    runner = scorer.runner
    need = {i: max_new_tokens - len(run.tokens[i]) for i in live}
    rows = sorted(live, key=lambda i: -need[i])
    last = runner.staging.to_device([run.tokens[i][-1] for i in rows])
    steps: list[tuple[list[int], torch.Tensor]] = []
    for step in range(need[rows[0]]):
        rows = [i for i in rows if need[i] > step]
        sids = [ids[i] for i in rows]
        runner.set_next_tokens(sids, last[: len(rows)])
        last = runner.decode_next(sids, decode_graphs).argmax(-1)
        steps.append((rows, last))
        run.decode_steps += 1
    for rows, toks in steps:
        for i, tok in zip(rows, toks.tolist(), strict=True):
            run.tokens[i].append(tok)
