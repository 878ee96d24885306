"""The FIFO continuous-batching scheduler over a ModelRunner's admission API.

Waiting sequences are admitted strictly in arrival order (no overtaking, so a long prompt cannot
starve) while the runner says they fit now and the packed prefill stays within its token budget;
admitted sequences join the running decode batch on the next step. A Sequence turns its sampled
tokens into text deltas, holding back any tail that could still become a stop string.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from k3verify.serving.runner import ModelRunner


@dataclass(eq=False)
class ScheduledSeq:
    """What the scheduler needs to know of a sequence; the engine keeps the rest."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)

    @property
    def num_reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


class Scheduler:
    """Owns the waiting queue and the running set; calls runner.admit/release, nothing else."""

    def __init__(self, runner: ModelRunner, *, max_prefill_tokens: int, max_running: int | None = None) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1; got {max_prefill_tokens}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None; got {max_running}")
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
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

    def schedule_prefill(self) -> list[ScheduledSeq]:
        """Admit waiting sequences in FIFO order; the first one is admitted even when its prompt alone
        exceeds the token budget (else it could never run)."""
        admitted: list[ScheduledSeq] = []
        budget = self.max_prefill_tokens
        while self.waiting:
            seq = self.waiting[0]
            if self.max_running is not None and len(self.running) >= self.max_running:
                break
            if admitted and len(seq.prompt_ids) > budget:
                break
            if not self.runner.can_admit(seq.num_reserved_tokens):
                break
            self.runner.admit(seq.seq_id, seq.num_reserved_tokens)
            self.waiting.popleft()
            self.running[seq.seq_id] = seq
            admitted.append(seq)
            budget -= len(seq.prompt_ids)
        return admitted

    def decode_batch(self, exclude: Iterable[ScheduledSeq] = ()) -> list[ScheduledSeq]:
        """Running sequences that already have a token to feed (those just prefilled are excluded)."""
        skip = {s.seq_id for s in exclude}
        return [s for s in self.running.values() if s.seq_id not in skip and s.output_ids]

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
