"""Admission: can a request ever be served, and when the waiting queue is admitted.

Prompt ids in the vocabulary, prompt + max_tokens within the context and within what the empty cache holds:
checked at submit, before anything is queued. Requests arriving together are admitted together (AdmissionHold).

The limits are a few numbers fixed when the engine is built (RequestLimits), so the HTTP server checks a
request with the engine's own rule even when it runs in a process of its own (api/engine_link.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from k3verify.serving.events import ContextLengthError
from k3verify.serving.runner import ModelRunner
from k3verify.serving.sampler import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """vocab_size; max_context: prompt + completion at most (the engine's decode graphs' context when tighter than
    the runner's); max_model_len: the runner's context (what /v1/models reports); cache_tokens: the most tokens one
    sequence's cache can ever hold (the empty cache: runner.can_ever_fit, which is monotone in the token count)."""

    vocab_size: int
    max_context: int
    max_model_len: int
    cache_tokens: int

    @classmethod
    def of(cls, runner: ModelRunner, vocab_size: int, max_context: int | None = None) -> RequestLimits:
        lo, hi = 0, runner.max_context
        while lo < hi:  # the largest count that can_ever_fit (0 if none)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if runner.can_ever_fit(mid) else (lo, mid - 1)
        limit = runner.max_context if max_context is None else max_context
        return cls(vocab_size=vocab_size, max_context=limit, max_model_len=runner.max_context, cache_tokens=lo)

    def check(self, prompt_ids: list[int], max_tokens: int) -> None:
        """Raise ValueError (bad ids) or ContextLengthError (too long, naming the numbers) for a request that never
        fits."""
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        total = len(prompt_ids) + max_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_context} tokens. However, you requested {total} "
                f"tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.")
        if total > self.cache_tokens:
            raise ContextLengthError(
                f"The request needs {total} tokens of cache ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                "completion), more than this server's KV cache holds even when empty. Reduce prompt or max_tokens.")

    def check_submission(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What a submit checks before anything is queued, in the engine or on the API side of the link:
        SamplingParams (TypeError), its token ids in the vocabulary (VocabError), then `check`."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams; got {type(params).__name__}")
        params.check_vocab(self.vocab_size)
        self.check(prompt_ids, params.max_tokens)

    def longest_completion(self, prompt_len: int) -> int:
        """The longest completion that could ever follow a prompt_len-token prompt (0: the prompt alone is too
        long)."""
        return max(min(self.max_context, self.cache_tokens) - prompt_len, 0)


# Admission hold: requests that arrive together are admitted together. A prefill pass has a large fixed cost that is
# host work (kl-48b-8l on the H200: ~33 ms from launch to launch for 128 to 3k prompt tokens, where the
# GPU needs 3-10 ms), and a burst of arrivals spread over a few tens of milliseconds was admitted over 2-3 such
# steps, each stalling every running stream. So the waiting queue is admitted once no request has arrived for
# ADMIT_QUIET_S, or once its oldest request has waited ADMIT_MAX_HOLD_S, or at once when the waiting requests fill
# every free slot; running rows keep decoding meanwhile. (TGI batches prefills for the same reason with its
# waiting_served_ratio.) A server whose last ADMIT_HISTORY admissions each took one request sees requests come one
# at a time: it admits at once (a hold there only adds its quiet time to every request's TTFT).
# The served bench's bursts (64 or 16 clients whose streams end together) arrived over 27-40 ms with gaps of up to
# 3.4-4.7 ms between requests, hence 5 ms and 40 ms.
ADMIT_QUIET_S = 0.005
ADMIT_MAX_HOLD_S = 0.040
ADMIT_HISTORY = 4


class AdmissionHold:
    """How long the waiting queue's admission should still wait for more arrivals (see ADMIT_QUIET_S)."""

    def __init__(self, quiet_s: float = ADMIT_QUIET_S, max_hold_s: float = ADMIT_MAX_HOLD_S) -> None:
        if quiet_s < 0 or max_hold_s < 0:
            raise ValueError(f"admission hold times must be >= 0; got {quiet_s}, {max_hold_s}")
        self.quiet_s, self.max_hold_s = quiet_s, max_hold_s
        self.admitted_sizes: deque[int] = deque(maxlen=ADMIT_HISTORY)  # requests per recent admitting step

    def record_admitted(self, num_admitted: int) -> None:
        """One step admitted num_admitted (> 0) requests."""
        self.admitted_sizes.append(num_admitted)

    def seconds(self, num_waiting: int, room: int, oldest_arrival: float, newest_arrival: float) -> float:
        """Seconds to wait still (0: admit now) for num_waiting requests, room of them admissible now, the oldest
        and newest of them submitted at these monotonic times."""
        if not num_waiting or self.quiet_s <= 0:
            return 0.0
        if len(self.admitted_sizes) == ADMIT_HISTORY and max(self.admitted_sizes) == 1:
            return 0.0  # requests come one at a time
        if num_waiting >= room:
            return 0.0
        return max(0.0, min(newest_arrival + self.quiet_s, oldest_arrival + self.max_hold_s) - time.monotonic())
