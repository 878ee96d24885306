"""Request limits: can a request ever be served.

Prompt ids in the vocabulary, prompt + max_tokens within the context and within what the empty cache holds:
checked at submit, before anything is queued. When the waiting queue is admitted is serving/admission_hold.py.

The limits are a few numbers fixed when the engine is built (RequestLimits), so the HTTP server checks a
request with the engine's own rule even when it runs in a process of its own (api/engine_link.py).
"""

from __future__ import annotations

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
