"""A request's generation state in the engine: sampled tokens, detokenized text, stops, where its events go.

A Request turns its sampled tokens into text deltas, holding back any tail that could still become a stop
string. The scheduler sees it only as a ScheduledSeq; the runner only as a sequence id.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from k3verify.serving.sampler import SamplingParams
from k3verify.serving.scheduler import ScheduledSeq


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
class Request(ScheduledSeq):
    """A request's generation state: sampled tokens, detokenized text, how much of it was sent, and the
    sink its events go to."""

    params: SamplingParams
    stop_ids: frozenset[int]  # eos ids (unless ignore_eos) and the request's stop_token_ids
    seed: int  # int64 key of the counter-based sampler (serving/sampler.py)
    decoder: Any  # k3verify.tokenizer.IncrementalDecoder
    sink: Callable[[Any], None]  # called with each EngineEvent (serving/engine.py)
    arrival: float
    text: str = ""
    sent: int = 0
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        self.cache_key = self.params.cache_key

    @property
    def next_position(self) -> int:
        """The position of the token to be sampled next (what the sampler's draws are keyed by with the seed)."""
        return len(self.prompt_ids) + len(self.output_ids)

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
