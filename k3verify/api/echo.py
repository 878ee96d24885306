"""Prompt logprobs for echo=true: every prompt token's logprob given the tokens before it, by the served model
(serving/prompt_logprobs.py, on the engine's thread between steps); the request itself is then generated as usual."""

from __future__ import annotations

import asyncio

from k3verify.api.errors import APIError, engine_unavailable
from k3verify.api.state import ServedEngine
from k3verify.serving.engine import ContextLengthError, EngineDeadError
from k3verify.serving.sampler import TokenLogprob


async def echo_logprobs(engine: ServedEngine, prompt_ids: list[int], num_top: int, max_tokens: int) -> \
        list[TokenLogprob | None]:
    """The prompt's logprobs for a request that the engine would accept (else the same 400 a completion gets)."""
    try:
        engine.validate(prompt_ids, max_tokens)
        return await asyncio.to_thread(engine.prompt_logprobs, prompt_ids, num_top)
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from None
