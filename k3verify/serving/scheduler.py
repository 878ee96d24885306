"""The FIFO continuous-batching scheduler: one StepPlan per engine step under a per-step token budget.

Every step decodes each running sequence that has a token to feed (one token each) and spends what is
left of the budget on prompt chunks: first the unfinished prompts of running sequences, then waiting
sequences admitted strictly in arrival order (no overtaking, so a long prompt cannot starve) while the
runner says they fit. A prompt longer than the budget is cut into chunks (on the KDA chunk grid where it
can be), so a long prompt never stalls the running streams for more than one budget of tokens.

The plan is committed when it is made: the engine launches step n+1 before it has read step n's tokens
(host/GPU overlap), so "has a token to feed" means "its last prompt chunk or its previous decode was
launched", not "its token reached the host".
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from k3verify.serving.runner import ModelRunner


@dataclass(eq=False)
class ScheduledSeq:
    """What the scheduler needs to know of a sequence; the engine keeps the rest."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)  # tokens that reached the host
    num_prefilled: int = 0  # prompt tokens whose chunk was launched
    num_launched: int = 0  # generated tokens whose sampling was launched (reached the host or not)
    cache_key: str | None = None  # whose prefix-cache entries it may use (per-key isolation), else None
    num_cached: int = 0  # prompt tokens a prefix-cache hit served (never prefilled)
    snapshot_points: tuple[int, ...] = ()  # prompt positions its prefill stops at for a prefix-cache snapshot
    cached_logits: Any = None  # a whole-prompt hit: its last position's logits (torch.Tensor), sampled from

    @property
    def num_reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def last_token(self) -> int:
        """The newest token the host holds (the prompt's last before any output)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled == len(self.prompt_ids)

    @property
    def can_decode(self) -> bool:
        """Its previous token was launched and the length limit leaves room for another."""
        return self.is_prefilled and 0 < self.num_launched < self.max_new_tokens

    @property
    def next_sample_position(self) -> int:
        """Absolute position of the token the next launched sampling produces (the counter-RNG key)."""
        return len(self.prompt_ids) + self.num_launched


@dataclass(frozen=True)
class PrefillChunk:
    seq: ScheduledSeq
    start: int  # prompt offsets [start, end) of this chunk
    end: int

    @property
    def tokens(self) -> list[int]:
        return self.seq.prompt_ids[self.start:self.end]

    @property
    def is_last(self) -> bool:
        """The chunk that ends the prompt: its logits sample the first generated token."""
        return self.end == len(self.seq.prompt_ids)


@dataclass
class StepPlan:
    decode: list[ScheduledSeq] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.end - c.start for c in self.prefill)


def spec_reservation(runner: ModelRunner, need: int, num_draft: int, limit: int) -> int:
    """Positions to reserve for a speculating sequence that needs `need`: k more where they fit (under `limit` and
    in the free cache), so that a row within k tokens of its end can still be scored or ride along (what a
    score accepts past max_new_tokens is dropped). Without them every such row takes a decode step of its own next
    to the batch's score pass, riders or not: close to one decode step per score step."""
    more = need + num_draft
    return more if more <= limit and runner.can_admit(more) else need


class Scheduler:
    """Owns the waiting queue and the running set; calls runner.admit/release, nothing else. With speculation on,
    `reserve_extra` = k positions are reserved past each sequence's need where they fit under `max_reserve`."""

    def __init__(self, runner: ModelRunner, *, max_step_tokens: int, max_running: int | None = None,
                 chunk_align: int = 64, reserve_extra: int = 0, max_reserve: int | None = None) -> None:
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1; got {max_step_tokens}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None; got {max_running}")
        if chunk_align < 1:
            raise ValueError(f"chunk_align must be >= 1; got {chunk_align}")
        self.runner = runner
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        self.reserve_extra = reserve_extra
        self.max_reserve = runner.max_context if max_reserve is None else max_reserve
        self.chunk_align = chunk_align
        self.waiting: deque[ScheduledSeq] = deque()
        self.running: dict[int, ScheduledSeq] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: ScheduledSeq) -> None:
        self.waiting.append(seq)

    def _reservation(self, seq: ScheduledSeq) -> int:
        if not self.reserve_extra:
            return seq.num_reserved_tokens
        return spec_reservation(self.runner, seq.num_reserved_tokens, self.reserve_extra, self.max_reserve)

    def schedule(self, admit: bool = True) -> StepPlan:
        """The next step: every decodable running sequence, then prompt chunks within the rest of the budget (of
        waiting sequences too unless `admit` is False). Commits the plan (prefill offsets and launched-token counts
        advance)."""
        plan = StepPlan(decode=[s for s in self.running.values() if s.can_decode])
        budget = self.max_step_tokens - len(plan.decode)
        for seq in self.running.values():
            if budget <= 0:
                break
            if not seq.is_prefilled:
                budget -= self._chunk(plan, seq, budget)
        while admit and self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.max_running is not None and len(self.running) >= self.max_running:
                break
            if not self.runner.can_admit(seq.num_reserved_tokens):
                break
            self._admit(seq)
            self.waiting.popleft()
            self.running[seq.seq_id] = seq
            budget -= self._chunk(plan, seq, budget)
        for seq in plan.decode:
            seq.num_launched += 1
        return plan

    def _admit(self, seq: ScheduledSeq) -> None:
        """Reserve the sequence's cache; with the prefix cache on, it starts at the deepest cached position."""
        if self.runner.prefix is None:
            self.runner.admit(seq.seq_id, self._reservation(seq))
            return
        resume = self.runner.prefix.admit(self.runner, seq.seq_id, self._reservation(seq), seq.prompt_ids,
                                          seq.cache_key)
        seq.num_prefilled = seq.num_cached = resume.position
        seq.snapshot_points, seq.cached_logits = resume.points, resume.logits

    def _chunk(self, plan: StepPlan, seq: ScheduledSeq, budget: int) -> int:
        """Append the next chunk of seq's prompt (at most `budget` tokens) to the plan; returns its length.
        A chunk that does not end the prompt is cut on the chunk_align grid when the budget allows."""
        start, left = seq.num_prefilled, len(seq.prompt_ids) - seq.num_prefilled
        n = min(left, budget)
        stop = next((p for p in seq.snapshot_points if p > start), None)
        if stop is not None and stop < start + n:
            n = stop - start  # a prefix-cache snapshot position (on the chunk grid)
        elif n < left and n >= self.chunk_align:
            n -= (start + n) % self.chunk_align
        plan.prefill.append(PrefillChunk(seq, start, start + n))
        seq.num_prefilled += n
        if seq.is_prefilled:
            seq.num_launched += 1
        return n

    def finish(self, seq_id: int) -> ScheduledSeq | None:
        """Drop a sequence wherever it is; running ones release their cache immediately."""
        seq = self.running.pop(seq_id, None)
        if seq is not None:
            self.runner.release(seq_id)
            return seq
        for queued in self.waiting:
            if queued.seq_id == seq_id:
                self.waiting.remove(queued)
                return queued
        return None

    def drain(self) -> list[ScheduledSeq]:
        """Remove every sequence (engine shutdown or failure), releasing what can be released."""
        seqs = list(self.running.values()) + list(self.waiting)
        for seq_id in list(self.running):
            with contextlib.suppress(Exception):  # the runner may be the thing that failed
                self.runner.release(seq_id)
        self.running.clear()
        self.waiting.clear()
        return seqs
