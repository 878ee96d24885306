"""Can a request ever be served? Prompt ids in the vocabulary, prompt + max_tokens within the context and
within what the empty cache holds. Checked at submit, before anything is queued."""

from __future__ import annotations

from k3verify.serving.events import ContextLengthError
from k3verify.serving.runner import ModelRunner


def check_request_fits(runner: ModelRunner, vocab_size: int, prompt_ids: list[int], max_tokens: int,
                       max_context: int | None = None) -> None:
    """Raise ValueError (bad ids) or ContextLengthError (too long, naming the numbers) for a request that never fits.
    `max_context`: a tighter limit than the runner's (the context the engine's decode graphs were captured for)."""
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    total, limit = len(prompt_ids) + max_tokens, runner.max_context if max_context is None else max_context
    if total > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
            f"({len(prompt_ids)} in the prompt, {max_tokens} for the completion). "
            "Please reduce the prompt or max_tokens.")
    if not runner.can_ever_fit(total):
        raise ContextLengthError(
            f"The request needs {total} tokens of cache ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            "completion), more than this server's KV cache holds even when empty. Reduce prompt or max_tokens.")


def longest_completion(runner: ModelRunner, prompt_len: int, max_context: int | None = None) -> int:
    """The longest completion that could ever follow a prompt_len-token prompt (0: the prompt alone is too long)."""
    lo, hi = 0, (runner.max_context if max_context is None else max_context) - prompt_len
    while lo < hi:  # can_ever_fit is monotone in the token count
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if runner.can_ever_fit(prompt_len + mid) else (lo, mid - 1)
    return max(lo, 0)
