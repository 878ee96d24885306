"""Prompt logprobs for echo=true: every prompt token scored given the tokens before it, by the served model.

One cacheless pass of the served model over the prompt (the packed-prefill path, run on the engine thread
between steps because the runner is not thread-safe); the request itself is then generated as usual.
"""

from __future__ import annotations

import asyncio

import torch

from k3verify.server.errors import APIError, engine_unavailable
from k3verify.serving.batch import PackedBatch
from k3verify.serving.engine import ContextLengthError, Engine, EngineDeadError
from k3verify.serving.sampler import TokenLogprob, token_logprobs


def score_prompt(engine: Engine, prompt_ids: list[int], num_top: int) -> list[TokenLogprob | None]:
    """[None, logprob of prompt[1] given prompt[:1], ...] with the num_top most likely tokens at each position."""
    def score() -> list[TokenLogprob | None]:
        model = engine.runner.model
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        logits = model.prefill(PackedBatch.build(ids, [len(prompt_ids)], device=model.device), all_logits=True)
        if logits.all_logits is None:
            raise RuntimeError("the served model returned no per-position logits for a scoring pass")
        scored = token_logprobs(logits.all_logits[:-1], prompt_ids[1:], [num_top] * (len(prompt_ids) - 1))
        return [None, *scored]

    result: list[TokenLogprob | None] = engine.call(score)
    return result


async def prompt_logprobs(engine: Engine, prompt_ids: list[int], num_top: int, max_tokens: int) -> \
        list[TokenLogprob | None]:
    """score_prompt for a request that the engine would accept (else the same 400 a completion gets)."""
    try:
        engine.validate(prompt_ids, max_tokens)
        return await asyncio.to_thread(score_prompt, engine, prompt_ids, num_top)
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from None
