"""Sequences and the FIFO continuous-batching scheduler over a ModelRunner's admission API.

Waiting sequences are admitted strictly in arrival order (no overtaking, so a long prompt cannot
starve) while the runner says they fit now and the packed prefill stays within its token budget;
admitted sequences join the running decode batch on the next step. A Sequence turns its sampled
tokens into text deltas, holding back any tail that could still become a stop string.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from k3verify.serving.sampler import SamplingParams


class ModelRunner(Protocol):
    """The engine-facing API of k3verify.serving.runner.ModelRunner."""

    max_context: int

    def can_ever_fit(self, num_tokens: int) -> bool: ...
    def can_admit(self, num_tokens: int) -> bool: ...
    def admit(self, seq_id: int, num_tokens: int) -> None: ...
    def prefill(self, seqs: list[tuple[int, list[int]]]) -> torch.Tensor: ...
    def decode(self, seqs: list[tuple[int, int]]) -> torch.Tensor: ...
    def release(self, seq_id: int) -> None: ...
    def check_integrity(self) -> None: ...


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


def find_stop(text: str, start: int, stops: Collection[str]) -> int | None:
    """Earliest index >= start where any stop string begins in text."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop_len(text: str, start: int, stops: Collection[str]) -> int:
    """Length of the longest tail of text[start:] that could still grow into a stop string."""
    longest = min(len(text) - start, max((len(s) for s in stops), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


@dataclass(eq=False, kw_only=True)
class Sequence(ScheduledSeq):
    """A request's generation state: sampled tokens, detokenized text, and how much of it was sent."""

    params: SamplingParams
    stop_ids: frozenset[int]  # eos ids (unless ignore_eos) and the request's stop_token_ids
    generator: torch.Generator
    decoder: Any  # k3verify.tokenizer.IncrementalDecoder
    text: str = ""
    sent: int = 0

    def append(self, token: int) -> tuple[str, str | None]:
        """Record a sampled token; returns (text now safe to send, finish_reason or None).
        A stop token adds no text; a stop string truncates the text before it."""
        self.output_ids.append(token)
        stops = self.params.stop
        final = token in self.stop_ids or len(self.output_ids) >= self.params.max_tokens
        if token not in self.stop_ids:
            self.text += self.decoder.push(token)
        if final:
            self.text += self.decoder.finish()
        stop_at = find_stop(self.text, self.sent, stops) if stops else None
        if stop_at is not None:
            end, finish = stop_at, "stop"
        elif final:
            end, finish = len(self.text), "stop" if token in self.stop_ids else "length"
        else:
            end, finish = len(self.text) - (partial_stop_len(self.text, self.sent, stops) if stops else 0), None
        delta, self.sent = self.text[self.sent:end], end
        return delta, finish


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
