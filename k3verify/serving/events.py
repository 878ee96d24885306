"""What the engine hands out and takes in: its errors, the events a request's sink receives, and the
shapes it needs of a tokenizer and a metrics observer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from k3verify.serving.sampler import TokenLogprob

if TYPE_CHECKING:  # serving/spec imports the engine's events
    from k3verify.serving.spec.step import SpecCounters


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it failed, stalled or was stopped)."""


class ContextLengthError(ValueError):
    """A request that can never fit: prompt + max_tokens over the context or the empty cache."""


class InjectedFault(RuntimeError):
    """An engine fault raised on purpose (tests, tools/chaos.py) to exercise the supervisor."""


class Tokenizer(Protocol):
    n_vocab: int

    def token_bytes(self, token_id: int) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...


class Observer(Protocol):
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_inter_token(self, seconds: float) -> None: ...
    def set_load(self, num_waiting: int, num_running: int) -> None: ...
    def count_restart(self) -> None: ...
    def count_nonfinite(self) -> None: ...
    def watch_speculation(self, counters: SpecCounters) -> None:
        """The speculator's running totals, read at every scrape (they only grow)."""
        ...


@dataclass
class EngineEvent:
    """One step's output for one request; `finished` once finish_reason or error is set."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    error: str | None = None
    code: str | None = None  # with error: "engine_unavailable" (restart, loop dead), "nonfinite_logits", ...
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (never prefilled)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class TokenText:
    """Token bytes for detokenization; ids the tokenizer does not know (model vocab padding) carry no text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def is_special(self, token_id: int) -> bool:
        return not 0 <= token_id < self.tokenizer.n_vocab or self.tokenizer.is_special(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.tokenizer.n_vocab:
            return f"<|unused_{token_id}|>".encode()
        return self.tokenizer.token_bytes(token_id)
